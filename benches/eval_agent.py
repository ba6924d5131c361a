"""Evaluate a model through an agent on a run's held-out problems (greedy by default).

Runs ``--agent`` (``file.py:Name`` with ``--kwargs`` JSON) once per held-out problem of the
run's config (the same held-out set training evaluated on), on an embedded HF engine with the
in-process client, and reports the mean reward, the fraction right at the first turn (reward
1.0) and at any turn (reward > 0), and model calls per session.

    python benches/eval_agent.py --run runs/agent-multiturn/trial0 \\
        --model runs/agent-multiturn/trial0/checkpoint \\
        --agent examples/agents/multiturn_math.py:MultiTurnMathAgent --kwargs '{"max_turns": 3}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch


def evaluate(
    model_path: str,
    agent_path: str,
    kwargs: dict,
    problems,
    temperature: float,
    max_tokens: int,
    batch: int,
) -> dict:
    """Run the agent once per problem; returns the summary (see the module docstring)."""
    from areal_fast.agent.bridge import EngineBridge
    from areal_fast.agent.chat_format import ChatFormat
    from areal_fast.agent.client import ChatBackend, SessionDefaults
    from areal_fast.agent.runner import AgentConfig, AgentRunner, load_agent
    from areal_fast.models.loading import load_causal_lm, load_tokenizer
    from areal_fast.rollout.hf_engine import HFEngine

    tokenizer = load_tokenizer(model_path)
    engine = HFEngine(load_causal_lm(model_path), tokenizer, batch)
    engine.start()
    holder, done, finished = {}, [], threading.Event()

    def backend(loop):
        holder["bridge"] = EngineBridge(engine, loop)
        return ChatBackend(ChatFormat(tokenizer), holder["bridge"].generate), holder["bridge"]

    def on_done(group):
        done.extend(group.sessions)
        if len(done) == len(problems):
            finished.set()

    runner = AgentRunner(
        load_agent(agent_path, kwargs), backend, AgentConfig(timeout=3600), on_done
    )
    runner.start()
    start = time.perf_counter()
    defaults = SessionDefaults(temperature=temperature, max_tokens=max_tokens)
    for i, p in enumerate(problems):
        runner.submit_group(
            i, {"question": p.question, "answer": p.answer, "uid": p.uid}, 1, i, defaults
        )
    while not finished.is_set():
        holder["bridge"].pump(0.2)
    seconds = time.perf_counter() - start
    runner.close()
    engine.close()
    rewards = [s.reward or 0.0 for s in done]
    return {
        "problems": len(done),
        "mean_reward": statistics.fmean(rewards),
        "first_turn_accuracy": sum(r == 1.0 for r in rewards) / len(done),
        "any_turn_accuracy": sum(r > 0 for r in rewards) / len(done),
        "calls_per_session": statistics.fmean(len(s.calls) for s in done),
        "dropped": sum(s.status != "done" for s in done),
        "seconds": seconds,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run directory (its config.yaml)")
    parser.add_argument("--model", help="model to evaluate (default: the run's model.path)")
    parser.add_argument("--agent", required=True)
    parser.add_argument("--kwargs", default="{}")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", help="append the result as one JSON line here")
    args = parser.parse_args(argv)
    from areal_fast.launch.config import load_config
    from areal_fast.launch.inputs import load_datasets

    # only the data and eval settings are used: the run's own agent section is not checked
    cfg = load_config(str(Path(args.run) / "config.yaml"), ['agent.path=""'])
    torch.manual_seed(cfg.seed)
    _, eval_set, _ = load_datasets(cfg)
    model = args.model or cfg.model.path
    result = evaluate(
        model,
        args.agent,
        json.loads(args.kwargs),
        eval_set,
        args.temperature,
        cfg.eval.max_new_tokens,
        args.batch,
    )
    result.update(
        model=model, agent=args.agent, kwargs=json.loads(args.kwargs), temperature=args.temperature
    )
    print(json.dumps(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
