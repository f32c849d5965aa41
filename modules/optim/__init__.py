"""What acts on the parameters' gradients and values: the optimizers of the two parameter families, batch-size
scaling rules, CowClip and the per-row L2 (on the batch's rows or on every row), and k-step model merging.

* :mod:`.optimizers` — dense and embedding optimizers (fused into FBGEMM where they can be);
* :mod:`.scaling_rules` — learning rates and L2 for a batch size (none, √, linear, CowClip);
* :mod:`.cowclip` — adaptive column-wise clipping of embedding gradients; :mod:`.cowclip_hooks` attaches it
  (and the batch's L2) to a sharded model;
* :mod:`.embedding_l2`, :mod:`.every_row_l2` — the L2 on every row at every step (lazily);
* :mod:`.kstep_merging` — averaging replicated parameters every k steps.

May import: modules.embedding, modules
"""
