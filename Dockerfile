# CUDA image: torch 2.11 (CUDA 13) + fbgemm-gpu 1.6.0 + torchrec 1.6.1, the project installed.
#   docker build -t ctr-pipeline .
#   docker run --gpus all --rm ctr-pipeline                                  # 1 GPU, synthetic default
#   docker run --gpus all --rm ctr-pipeline torchrun --nproc_per_node=8 -m pipeline.train topology=8gpu_node
FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
RUN python3 -m venv $VIRTUAL_ENV \
    && pip install --no-cache-dir torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130 \
    && pip install --no-cache-dir fbgemm-gpu==1.6.0 torchrec==1.6.1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY modules ./modules
COPY conf ./conf
COPY benchmarks ./benchmarks
RUN pip install --no-cache-dir -e . && python -c "import torchrec, fbgemm_gpu, lightning, hydra, mlflow"

CMD ["python", "-m", "pipeline.train", "topology=1gpu"]
