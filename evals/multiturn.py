"""A multi-turn funcfit environment with a code-execution tool, driven through the OpenAI API.

Why: agentic RL episodes interleave policy turns with tool calls whose results the policy reads
before answering again. This is the smallest such loop on deltaloop's pieces:

1. the policy (served by the rollout worker's ``/v1/chat/completions``) is shown a funcfit
   prompt (values of an unknown f at x = 0..5) and answers with an expression in ``x``;
2. the **tool** runs that expression in the sandbox pool (``pool.exec``: untrusted code, never in
   this process) on the *shown* points and returns what it printed;
3. if the values differ from the shown ones, the tool output goes back to the policy as the next
   user turn and it answers again (up to ``max_turns``);
4. the final answer is scored by the environment (:meth:`evals.funcfit.FuncfitEnv.score`: the
   *hidden* points in the sandbox verifier), like single-turn funcfit.

An episode in which the sandbox infrastructure failed (a tool call or the final verification that
stayed ``infra`` after the pool's retries) is ``masked``: the policy read a tool answer that says
nothing about its expression, or its answer was never checked, so the episode is not a reward.

Episodes take the environment's :class:`~evals.env.Item` s, so any funcfit split feeds them.

Every turn keeps what training needs: the prompt token ids the server rendered, the sampled token
ids, their log-probs and the weight version that produced them (the rollout server's RL extension
fields). Episodes run in threads so their requests share the engine's continuous batch.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from evals.env import Item, infra_failed
from evals.funcfit import FuncfitEnv, extract_expression, to_program

if TYPE_CHECKING:
    from infra.sandbox import SandboxPool

SYSTEM = "Answer with one Python expression in x. A tool evaluates it at x=0..5."


@dataclass
class Turn:
    """One policy turn and the tool's answer to it."""

    answer: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version: int
    tool_output: str = ""
    tool_reason: str = ""


@dataclass
class Episode:
    """A finished episode: its turns and the final reward on hidden points."""

    problem_id: str
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    reason: str = ""
    masked: bool = False  # the sandbox infrastructure failed in this episode: not a reward (see module doc)

    @property
    def versions(self) -> set[int]:
        return {t.version for t in self.turns}


def tool_program(expr: str) -> str:
    """The program the tool runs: define ``f`` from ``expr``, print its values at x = 0..5 as JSON."""
    return to_program(expr) + "import json\nprint(json.dumps([f(x) for x in range(6)]))\n"


def run_tool(pool: "SandboxPool", expr: str, timeout_s: float | None = None) -> tuple[str, str]:
    """Run ``expr`` in a sandbox; returns (output shown to the policy, sandbox reason: ``infra`` when
    the sandbox infrastructure failed on every retry)."""
    res = pool.exec(tool_program(expr), timeout_s=timeout_s)
    if infra_failed(res):
        return "error: the tool is unavailable", "infra"
    if res.reason == "ok" and res.exit_code == 0:
        return res.stdout_tail.strip(), res.reason
    err = (res.stderr_tail.strip().splitlines() or [res.reason])[-1]
    return f"error: {err[:200]}", res.reason


def shown_values(item: Item) -> list[int]:
    """The values of f at x = 0..5 that a funcfit prompt shows (``"3,5,7,9,11,13="``)."""
    return [int(v) for v in str(item.prompt).rstrip("=").split(",")]


def run_episode(client: Any, model: str, problem: Item, pool: "SandboxPool", max_turns: int = 3,
                max_tokens: int = 24, temperature: float = 1.0, seed: int = 0,
                env: FuncfitEnv | None = None) -> Episode:
    """Play one episode on a funcfit item against an OpenAI-compatible ``client`` (``openai.OpenAI``)."""
    env = env or FuncfitEnv()
    want = shown_values(problem)
    prompt = str(problem.prompt)
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    ep = Episode(problem_id=problem.id)
    for k in range(max_turns):
        resp = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                              temperature=temperature, seed=seed * 1000 + k, stop=["\n"])
        choice = resp.choices[0]
        extra = choice.model_extra or {}
        answer = choice.message.content or ""
        expr = extract_expression(answer)
        out, reason = run_tool(pool, expr)
        ep.turns.append(Turn(answer=answer, prompt_token_ids=list(extra.get("prompt_token_ids", [])),
                             token_ids=list(extra.get("token_ids", [])), logprobs=list(extra.get("token_logprobs", [])),
                             version=int((resp.model_extra or {}).get("weight_version", 0)), tool_output=out,
                             tool_reason=reason))
        try:
            if json.loads(out) == want:
                break
        except ValueError:
            pass
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"f gave {out}; want {json.dumps(want)}. {prompt}"}]
    result = env.score([problem], [ep.turns[-1].answer], pool)[0]
    ep.reward, ep.reason = result.reward, result.reason
    ep.masked = result.masked or any(t.tool_reason == "infra" for t in ep.turns)
    if ep.masked:
        ep.reward, ep.reason = 0.0, "infra"
    return ep


def run_episodes(client: Any, model: str, problems: list[Item], pool: "SandboxPool", concurrency: int = 8,
                 **kwargs: Any) -> list[Episode]:
    """Episodes for ``problems`` in parallel threads (their requests batch together on the server)."""
    with ThreadPoolExecutor(max(1, concurrency)) as ex:
        futures = [ex.submit(run_episode, client, model, p, pool, seed=i, **kwargs) for i, p in enumerate(problems)]
        return [f.result() for f in futures]
