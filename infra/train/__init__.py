"""Training math and the trainer service.

``grpo`` holds the GRPO advantages, batch building and clipped loss; ``sft`` the supervised
warm-start. Both are plain functions over a Hugging Face causal LM, usable in one process or on
each rank of a data-parallel group (see the normalisation notes in :mod:`infra.train.grpo`).
"""
