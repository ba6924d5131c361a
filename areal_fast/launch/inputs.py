"""A run's inputs, loaded and checked before any worker starts: the training and held-out
problems (questions in both are dropped from training), a batch they can fill and the
lengths they need."""

from __future__ import annotations

from dataclasses import dataclass

from areal_fast.controller.requests import ChatPrompts
from areal_fast.data.config import USER_TASKS
from areal_fast.data.tasks import drop_eval_overlap, load_problems
from areal_fast.data.user_data import load_user_data
from areal_fast.launch.config import ConfigError, ExperimentConfig
from areal_fast.launch.packages import check_packages
from areal_fast.launch.run_dir import check_run_dir, check_trajectory_dir
from areal_fast.launch.worker_specs import check_resources, check_reward, check_sync
from areal_fast.models.loading import load_model_config, load_tokenizer
from areal_fast.models.teacher import check_teacher


@dataclass
class RunInputs:
    """A training run's loaded and checked inputs.

    Attributes
    ----------
    prompts : ChatPrompts
        Turns a problem into the model's prompt tokens.
    tokenizer
        The model's tokenizer (saved with the final model).
    train_set, eval_set : list of Problem
        Training and held-out problems.
    removed : int
        Training problems dropped because the held-out set has their question.
    """

    prompts: ChatPrompts
    tokenizer: object
    train_set: list
    eval_set: list
    removed: int


def check_inputs(cfg: ExperimentConfig) -> RunInputs:
    """Load and check everything that can fail on bad input (packages, the run directory,
    resources, reward, agent, data, model, lengths) before anything is written or started.

    Raises
    ------
    ConfigError, ValueError, FileNotFoundError, ImportError
        Bad input, one line naming the key or file.
    """
    check_packages(cfg)  # raises the one-line error before any slow work
    check_run_dir(cfg)
    check_sync(cfg)
    check_resources(cfg)
    check_reward(cfg)
    if cfg.agent.path:
        from areal_fast.agent.runner import load_agent

        # a bad agent.path fails here, at once; the agent is built in the rollout workers
        load_agent(cfg.agent.path, cfg.agent.kwargs, construct=False)
        check_trajectory_dir(cfg)
    train_set, eval_set, removed = load_datasets(cfg)
    check_batch_size(cfg, train_set, removed)
    tokenizer = load_tokenizer(cfg.model.path)  # also builds the demo model cache once
    prompts = ChatPrompts(tokenizer, cfg.data.instruction)
    model_config = load_model_config(cfg.model.path)
    if cfg.actor.lora.enabled:  # a target naming no module fails here, at once
        from areal_fast.train.lora import check_lora_targets

        check_lora_targets(model_config, cfg.actor.lora)
    if cfg.actor.distill.enabled:  # a teacher that cannot read the student's tokens
        check_teacher(cfg.actor.distill.teacher_path, cfg.model.path)
    max_positions = getattr(model_config, "max_position_embeddings", None)
    check_lengths(cfg, prompts, train_set + eval_set, max_positions)
    return RunInputs(prompts, tokenizer, train_set, eval_set, removed)


def unique_questions(problems):
    """``problems`` without repeated questions (by ``prompt_id``: the question, or the chat
    messages), first occurrence kept, order preserved."""
    seen, out = set(), []
    for problem in problems:
        if problem.prompt_id not in seen:
            seen.add(problem.prompt_id)
            out.append(problem)
    return out


def load_datasets(cfg: ExperimentConfig):
    """Training and distinct held-out problems; held-out questions are removed from training.

    The held-out set is the first ``data.eval_size`` distinct questions of the eval split
    (GSM8K: a subset drawn with ``data.eval_seed``, in file order; generated tasks: drawn
    with ``data.eval_seed``; jsonl/hf: see :func:`~areal_fast.data.user_data.load_user_data`,
    whose rows drawn as held-out are never training rows).
    """
    d = cfg.data
    if d.task in USER_TASKS:
        train_set, pool = load_user_data(d)
        eval_set = _distinct(cfg, pool)
    else:
        eval_set = load_eval_set(cfg)
        train_set = _generated_or_gsm8k_train(cfg)
    train_set, removed = drop_eval_overlap(train_set, eval_set)
    if not train_set:
        raise ValueError(
            f"data: every training problem also appears in the held-out set "
            f"({removed} removed); raise data.train_size or change the task"
        )
    return train_set, eval_set, removed


def check_batch_size(cfg: ExperimentConfig, train_set, removed: int) -> None:
    """Fail before any work when a step would take more problems than training has (each
    step draws ``batch_size`` problems without repeats until the set runs out).

    Raises
    ------
    ConfigError
        Naming ``batch_size``, the number of training problems and the key that sets it.
    """
    if cfg.batch_size <= len(train_set):
        return
    d = cfg.data
    size = "null" if d.train_size is None else d.train_size
    source = f"data.train_size = {size}"
    if d.task in USER_TASKS:
        source = f"the training rows of data.path = {d.path!r}, {source}"
    if removed:
        source += f", less {removed} also held out"
    fix = "lower batch_size" + (" or raise data.train_size" if d.train_size is not None else "")
    raise ConfigError(
        f"batch_size = {cfg.batch_size} is more than the {len(train_set)} training problems "
        f"({source}): a step would train some of them twice; {fix}"
    )


def _generated_or_gsm8k_train(cfg: ExperimentConfig):
    d = cfg.data
    return load_problems(
        d.task,
        split=d.train_split,
        size=d.train_size,
        seed=d.train_seed,
        path=d.path,
        task_kwargs=d.task_kwargs,
    )


def load_eval_set(cfg: ExperimentConfig):
    """The held-out problems: the first ``data.eval_size`` distinct questions of the eval
    split (see :func:`load_datasets`).

    Raises
    ------
    ValueError
        The task offers fewer distinct questions than ``data.eval_size``.
    """
    d = cfg.data
    if d.task in USER_TASKS:
        return _distinct(cfg, load_user_data(d)[1])
    # generated tasks repeat questions: draw extra so that eval_size distinct ones remain
    pool_size = d.eval_size if d.task == "gsm8k" else 3 * d.eval_size
    pool = load_problems(
        d.task,
        split=d.eval_split,
        size=pool_size,
        seed=d.eval_seed,
        path=d.path,
        task_kwargs=d.task_kwargs,
    )
    return _distinct(cfg, pool)


def _distinct(cfg: ExperimentConfig, pool):
    """The first ``data.eval_size`` distinct questions of ``pool``."""
    d = cfg.data
    eval_set = unique_questions(pool)[: d.eval_size]
    if len(eval_set) < d.eval_size:
        raise ValueError(
            f"data.eval_size = {d.eval_size}: the task offers only "
            f"{len(eval_set)} distinct held-out questions"
        )
    return eval_set


def check_lengths(cfg: ExperimentConfig, prompts: ChatPrompts, problems, max_positions) -> None:
    """Fail before any work if the longest possible sequence fits no micro-batch or model.

    Raises
    ------
    ValueError
        Naming ``actor.max_tokens_per_mb`` or ``rollout.max_new_tokens`` /
        ``eval.max_new_tokens``.
    """
    longest_prompt = max(len(prompts(p)) for p in problems)
    new_tokens = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    check_positions(
        "rollout.max_new_tokens / eval.max_new_tokens", new_tokens, longest_prompt, max_positions
    )
    if cfg.rollout.engine in ("vllm", "vllm_server") and cfg.rollout.vllm.max_model_len:
        check_positions(
            "rollout.max_new_tokens / eval.max_new_tokens",
            new_tokens,
            longest_prompt,
            cfg.rollout.vllm.max_model_len,
            "rollout.vllm.max_model_len =",
        )
    sequence = (
        f"longest prompt {longest_prompt} + rollout.max_new_tokens {cfg.rollout.max_new_tokens}"
    )
    need = longest_prompt + cfg.rollout.max_new_tokens
    if cfg.actor.keep_groups:  # a whole group goes in one micro-batch
        need *= cfg.rollout.group_size
        sequence = f"rollout.group_size {cfg.rollout.group_size} × ({sequence})"
    if need > cfg.actor.max_tokens_per_mb:
        what = "a GRPO group (actor.keep_groups)" if cfg.actor.keep_groups else "one sequence"
        raise ValueError(
            f"actor.max_tokens_per_mb = {cfg.actor.max_tokens_per_mb} is smaller "
            f"than {what} can be: {sequence} = {need} tokens; set "
            f"actor.max_tokens_per_mb >= {need}"
        )


def check_positions(
    key: str, new_tokens: int, longest_prompt: int, max_positions, limit: str = "the model's"
) -> None:
    """The longest prompt plus ``new_tokens`` (the value of ``key``) must fit the model's
    ``max_positions`` (None or 0: no limit known); ``limit`` names what sets them.

    Raises
    ------
    ValueError
        Naming ``key``, the longest prompt and the model's positions.
    """
    if max_positions and longest_prompt + new_tokens > max_positions:
        raise ValueError(
            f"{key} = {new_tokens}: with the longest prompt ({longest_prompt} tokens) this "
            f"exceeds {limit} {max_positions} positions"
        )
