"""Process plumbing: where a process stands in a launch (:mod:`.launch`), user errors and their hints
(:mod:`.errors`), preemption signals (:mod:`.signals`), the Hydra job (:mod:`.hydra_job`), NUMA
binding, the heap, and ending a process without teardown (:mod:`.process_exit`).

May import: modules
"""
