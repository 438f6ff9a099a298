"""*warm start* data: the supervised examples of every warm-start step, drawn from the environment.

The trainer ranks run the SFT loop (:mod:`infra.train.sft`) but do not import the environment
(``infra/`` sits below ``evals/``): this stage draws each step's (prompt, target) pairs from the
train split and stores them as one artefact, and the trainer's ``warmstart`` op reads them back.
The pairs are a function of the config alone, so a retried or resumed provision reuses the stored
artefact.
"""

from __future__ import annotations

from infra.stages.context import RunContext
from infra.storage import put_json


def store_warmstart_examples(ctx: RunContext) -> str:
    """Store the warm start's per-step pairs under ``runs/<run>/warmstart/examples.json``; returns the key."""
    from evals.env import sft_examples_of
    from evals.registry import cached_environment
    from infra.train.sft import sft_step_examples

    key = ctx.key(None, "warmstart", "examples.json")
    if not ctx.store.exists(key):
        wcfg = ctx.cfg.warmstart
        env = cached_environment(ctx.cfg.env)
        steps = sft_step_examples(lambda seed, n: sft_examples_of(env, seed, n), ctx.cfg.env.seed, wcfg.steps,
                                  wcfg.batch_size)
        put_json(ctx.store, key, {"steps": steps})
    return key
