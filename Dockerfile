# CUDA image: torch 2.14.1 (the package index's build is CUDA 13) + fbgemm-gpu 1.9.0 + torchrec 1.9.2 —
# the same torch and torchrec as the CPU stack CI tests — and the project installed from its wheel.
#   docker build -t ctr-pipeline .
#   docker run --gpus all --rm ctr-pipeline                                   # ctr train topology=1gpu
#   docker run --gpus all --rm -v $PWD/runs:/work ctr-pipeline ctr train topology=1gpu trainer.batch_size=65536
#   docker run --gpus all --rm ctr-pipeline torchrun --nproc_per_node=8 -m pipeline.commands.train topology=8gpu_node
FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04 AS base
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
RUN python3 -m venv $VIRTUAL_ENV \
    && pip install --no-cache-dir torch==2.14.1 fbgemm-gpu==1.9.0 torchrec==1.9.2

# The wheel: pipeline/, modules/ and conf/ (as the package ctr_conf); nothing of the checkout stays.
FROM base AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY modules ./modules
COPY conf ./conf
RUN pip wheel --no-deps --no-cache-dir -w /dist .

FROM base
COPY --from=wheel /dist /dist
RUN pip install --no-cache-dir /dist/ctr_pipeline-*.whl && rm -rf /dist \
    && python -c "import torchrec, fbgemm_gpu, lightning, hydra, mlflow, ctr_conf" && ctr --help
WORKDIR /work
CMD ["ctr", "train", "topology=1gpu"]
