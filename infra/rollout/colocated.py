"""The rollout service of ``weight_sync.placement: colocated``: generation on the trainer ranks.

No rollout worker process exists and no weights move: :meth:`ColocatedRollout.rollout` asks the
trainer group (bound by provision through :meth:`ColocatedRollout.bind_trainer`, again after a
trainer restart) to generate the batch with the parameters it trains, split across its ranks
(:meth:`infra.train.colocated_ops.ColocatedOps.op_colocated_rollout`); the rollouts object is the
one a rollout worker writes. :meth:`ColocatedRollout.load` does not transfer anything: it checks
that the trainer holds the requested version and answers the record a worker load gives, with zero
seconds. This is the default placement of veRL, OpenRLHF, SkyRL, slime and TRL on one node.

What it does not offer (refused at config validation, :mod:`infra.configs.placement`, or here):
an HTTP endpoint (``url``: the OpenAI API that multi-turn and agent environments drive needs a
rollout worker), the vLLM engine, sharded parameters (FSDP, ZeRO-3) and LoRA adapters, and
``loop.mode: async`` (generation and training would have to overlap on the same ranks). A trainer
group that dies during a rollout batch fails the batch's stage (the group is replaced at the next
train step, :func:`infra.stages.steps.train_step`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from infra.config import RunConfig
from infra.errors import DeltaloopError
from infra.storage import ObjectStore


class ColocatedError(DeltaloopError):
    """A colocated rollout call that cannot be served as asked (no trainer bound, no endpoint, a
    version the trainer does not hold). Not retryable: asking again gets the same answer."""

    retryable = False


class ColocatedRollout:
    """The rollout-service interface (:class:`~infra.rollout.service.RolloutService`'s) over the
    trainer group; ``report`` is accepted for the same constructor and unused (nothing restarts)."""

    def __init__(self, cfg: RunConfig, run_id: str, store: ObjectStore, run_dir: Path,
                 init_dir: str | None = None, report: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.store = store
        self.run_dir = Path(run_dir)
        self.restarts = 0  # no worker to replace: the trainer group's restarts are the flow's
        self.served: int | None = None  # the version the last load confirmed
        self.pid: int | None = None
        self._trainer: Any = None

    @property
    def url(self) -> str:
        """There is no rollout endpoint in this placement: an OpenAI-API client needs a worker."""
        raise ColocatedError("weight_sync.placement=colocated has no rollout worker, so no HTTP/OpenAI endpoint; "
                             "use placement object_store or broadcast for multi-turn or OpenAI-API environments")

    @property
    def where(self) -> str:
        """Where rollouts are generated, for progress lines."""
        return "on the trainer ranks (colocated)"

    def start(self) -> None:
        """Nothing to start: the trainer group generates."""

    def launch(self) -> None:
        """Nothing to launch (provision starts the trainer group itself)."""

    def wait_ready(self) -> None:
        """Ready as soon as a trainer is bound."""

    def dead_reason(self) -> str | None:
        """None: there is no process of its own (the trainer group's health is the trainer service's)."""
        return None

    def bind_trainer(self, trainer: Any) -> None:
        """Generate on ``trainer`` (a :class:`~infra.train.service.TrainerService`) from now on."""
        self._trainer = trainer

    def _group(self) -> Any:
        if self._trainer is None:
            raise ColocatedError("colocated rollout: no trainer group is bound yet (provision binds it once the "
                                 "trainer is up)")
        return self._trainer

    def version(self) -> int:
        """The weights version the trainer ranks hold (what a rollout batch is sampled with)."""
        return int(self._group().call("colocated_version")["version"])

    def load(self, version: int | None = None) -> dict[str, Any]:
        """Check the version the trainer holds against ``version`` (None: whatever it holds) and
        answer a worker load's record: ``version``, ``applied`` and ``seconds`` (0: nothing moves).

        A version newer than the trainer's raises :class:`ColocatedError`. An older one is what a
        resumed run asks while it replays stored batches (the trainer restored a later checkpoint):
        it is acknowledged, and a rollout batch asked before the versions meet again is refused
        (:meth:`rollout`: the ranks generate only with the version they hold)."""
        held = self.version()
        if version is not None and version > held:
            raise ColocatedError(f"colocated rollout cannot serve weight version {version}: the trainer ranks hold "
                                 f"version {held} (this placement generates only with the current parameters)")
        self.served = held if version is None else version
        return {"version": self.served, "applied": True, "seconds": 0.0, "bytes": 0}

    def rollout(self, prompts_key: str, out_key: str, n: int, temperature: float, max_new_tokens: int,
                seed: int) -> dict[str, Any]:
        """Generate ``n`` samples per prompt on the trainer ranks; the rollouts land at ``out_key``.
        The ranks refuse (:class:`~infra.train.colocated_ops.VersionMismatch`) if they do not hold the
        version last loaded: every batch is generated by the version the flow synced."""
        return self._group().call("colocated_rollout", prompts_key=prompts_key, out_key=out_key, n=n,
                                  temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                                  version=self.served)

    def close(self) -> None:
        """Forget the trainer (the cluster closes the trainer group itself). Idempotent."""
        self._trainer = None
