"""Config loading (did-you-mean, YAML positions, emptying a mapping), the generated config
reference and docs/config.md, and the checks that run before anything is written."""

from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import GSM8K_DIR, REPO
from omegaconf import OmegaConf

from areal_fast.launch import config_keys
from areal_fast.launch import config_reference as ref
from areal_fast.launch.config import ConfigError, ExperimentConfig, did_you_mean, load_config

ARITH = REPO / "examples" / "arith.yaml"
GSM8K = REPO / "examples" / "gsm8k.yaml"
needs_gsm8k = pytest.mark.skipif(
    not (GSM8K_DIR / "train.jsonl").is_file(), reason=f"GSM8K files not present at {GSM8K_DIR}"
)


def _leaves(node, prefix=""):
    """Dotted leaf keys of a plain nested dict (an empty mapping is a leaf)."""
    out = set()
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out


def test_reference_has_every_key_with_a_meaning():
    keys = ref.config_keys()
    names = [k.key for k in keys]
    expected = _leaves(OmegaConf.to_container(OmegaConf.structured(ExperimentConfig)))
    assert sorted(names) == sorted(expected) and len(names) == len(set(names))
    for key in keys:
        assert key.meaning.strip() and key.type and key.default, key
    by_name = {k.key: k for k in keys}
    for name in (
        "max_seconds",
        "tags",
        "data.train_split",
        "data.eval_split",
        "actor.loss.behav_weight_mode",
        "scheduler.dist_timeout",
        "scheduler.ray_num_cpus",
    ):
        assert name in by_name, name
    assert by_name["actor.optim.lr"].default == "1e-05"
    assert by_name["actor.optim.lr"].type == "float"
    assert by_name["max_seconds"].type == "float | None"
    assert by_name["max_seconds"].default == "null"
    assert by_name["tags"].type == "list[str]" and by_name["tags"].default == "[]"
    assert by_name["data.task_kwargs"].type == "dict"
    assert by_name["rollout.drop_stale"].default == "true"
    assert by_name["experiment_name"].default == "null"
    # meanings come from the comment beside the field, or else the docstring's entry
    assert "openai/gsm8k" in by_name["data.path"].meaning
    assert "{split}.jsonl" in by_name["data.path"].meaning
    assert "data.task_kwargs={}" in by_name["data.task_kwargs"].meaning
    assert by_name["actor.loss.behav_weight_mode"].meaning.startswith('"mask" zeroes tokens')
    assert (
        "drop groups that would be trained more than η versions"
        in by_name["rollout.drop_stale"].meaning
    )
    sections = [s.name for s in ref.sections()]
    assert sections[:4] == ["top level", "model", "data", "rollout"]
    assert {"actor.loss", "actor.optim", "launcher.timeouts"} <= set(sections)


@dataclass
class _Undocumented:
    """A section."""

    documented: int = 1  # has a meaning
    bare: int = 2


def test_a_field_without_meaning_is_refused():
    with pytest.raises(ValueError, match="config key 'bare' has no meaning"):
        config_keys.sections(_Undocumented)
    assert config_keys.field_meanings(_Undocumented) == {"documented": "has a meaning", "bare": ""}


def test_docs_config_md_is_up_to_date():
    path = REPO / "docs" / "config.md"
    assert path.is_file(), f"docs/config.md is missing: run `{ref.REGENERATE}`"
    assert path.read_text(encoding="utf-8") == ref.render_markdown(), (
        f"docs/config.md is out of date with the config dataclasses: run `{ref.REGENERATE}`"
    )


def test_text_reference_lists_every_key_with_its_default():
    text = ref.render_text()
    for key in ref.config_keys():
        assert f"  {key.key}  ({key.type}) = {key.default}\n" in text, key.key
    assert "[actor.optim]" in text


def test_unknown_keys_get_the_closest_known_ones(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(str(ARITH), ["actor.optim.lrr=1e-5"])
    assert str(info.value).startswith(
        "unknown config key 'actor.optim.lrr'; did you mean 'actor.optim.lr'"
    )
    assert "'actor.optim.lrr=1e-5'" in str(info.value)
    with pytest.raises(ConfigError, match="did you mean 'total_steps'"):
        load_config(str(ARITH), ["total_stepz=3"])
    # a key in the wrong section: matched by its last part
    assert did_you_mean("behav_weight_mode").startswith(
        "; did you mean 'actor.loss.behav_weight_mode'"
    )
    assert did_you_mean("actor.optimm").startswith("; did you mean 'actor.optim'")
    assert did_you_mean("zzzzqqq") == ""
    config = tmp_path / "c.yaml"
    config.write_text("seed: 3\nactor:\n  optim:\n    lrr: 1.0e-5\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(config))
    assert str(info.value) == (
        f"config file {config}:4:5: unknown config key "
        f"'actor.optim.lrr'; did you mean 'actor.optim.lr'?"
    )


def test_yaml_errors_give_file_line_and_column(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("seed: 1\nrollout:\n  group_size: [4\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(broken))
    assert str(info.value).startswith(f"config file {broken}:4:1: cannot parse YAML (")
    bad_value = tmp_path / "value.yaml"
    bad_value.write_text("seed: 1\nrollout:\n  group_size: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(bad_value))
    assert str(info.value) == (
        f"config file {bad_value}:3:3: rollout.group_size = 1 must be "
        f">= 2 (GRPO compares samples of a prompt)"
    )
    # the same check from the command line names the key without the file's position
    with pytest.raises(ConfigError) as info:
        load_config(str(bad_value), ["rollout.group_size=0"])
    assert str(info.value).startswith("rollout.group_size = 0 must be >= 2")
    wrong_type = tmp_path / "type.yaml"
    wrong_type.write_text("total_steps: abc\n")
    with pytest.raises(
        ConfigError,
        match=rf"^config file {wrong_type}:1:1: config key "
        r"'total_steps': Value 'abc'",
    ):
        load_config(str(wrong_type))
    # a value on the command line that is not YAML: one line naming the item
    with pytest.raises(ConfigError) as info:
        load_config(None, ["slurm.modules=[a{]"])
    assert str(info.value) == (
        "override 'slurm.modules=[a{]': its value is not valid YAML (did not find expected "
        "',' or ']')"
    )


def test_section_titles_read_as_one_sentence():
    """Each section's title in `areal-fast config` and docs/config.md is its dataclass's
    own sentence: no parenthesis appended to it or nested in another, no internal module."""
    import re

    for section in ref.sections():
        about = section.about
        assert about and about.endswith("."), section.name
        assert "((" not in about and "))" not in about and ". (" not in about, about
        assert not re.search(r"areal_fast\.\w+\.", about), about
    text = ref.render_text()
    assert "[actor.lora]  LoRA on the trained policy" in text
    assert "\n[logging]  Dashboards besides metrics.jsonl and progress.png: TensorBoard" in text


def test_a_section_check_names_the_full_key_once(tmp_path):
    """A nested section's check that names its key from a section above (``lora.rank`` in
    ``actor.lora``) is reported under the full key, not ``actor.lora.lora.rank``."""
    with pytest.raises(ConfigError) as info:
        load_config(str(ARITH), ["actor.lora.rank=-1"])
    assert str(info.value) == "actor.lora.rank = -1 must be an int >= 0 (0: off)"
    config = tmp_path / "lora.yaml"
    config.write_text("actor:\n  lora: {rank: -3}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(config))
    assert str(info.value) == (
        f"config file {config}:2:10: actor.lora.rank = -3 must be an int >= 0 (0: off)"
    )
    with pytest.raises(ConfigError, match=r"^rollout\.vllm\.max_model_len = 1 must be"):
        load_config(str(ARITH), ["rollout.vllm.max_model_len=1"])


def test_a_conflict_with_a_command_line_item_blames_the_item(tmp_path):
    """Two keys that contradict each other, one from the file and one from the command line:
    the error names the command-line item, not the file's line of the other key."""
    config = tmp_path / "resume.yaml"
    config.write_text("total_steps: 1\nresume: true\nbatch_size: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(config), ["overwrite=true"])
    assert str(info.value) == (
        "command line 'overwrite=true': resume=true and overwrite=true contradict each other"
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(config), ["resume=false", "scheduler.train_world_size=8"])
    assert str(info.value).startswith("scheduler.train_world_size = 8 is more than batch_size")
    config.write_text("batch_size: 4\nscheduler: {train_world_size: 8}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(config))
    assert str(info.value).startswith(f"config file {config}:2:13: scheduler.train_world_size")
    with pytest.raises(ConfigError) as info:
        load_config(str(config), ["batch_size=2"])
    assert str(info.value).startswith(
        "command line 'batch_size=2': scheduler.train_world_size = 8 is more than batch_size = 2"
    )


def test_experiment_name_defaults_to_the_config_files_name(tmp_path):
    """A config without experiment_name never lands in another config's run directory."""
    config = tmp_path / "my_task.yaml"
    config.write_text("total_steps: 3\n")
    cfg = load_config(str(config))
    assert cfg.experiment_name == "my_task"
    assert cfg.run_dir == Path("runs") / "my_task" / "trial0"
    assert load_config(str(config), ["experiment_name=other"]).experiment_name == "other"
    assert load_config(str(ARITH)).experiment_name == "grpo-arith"  # the file sets it
    assert load_config(None).experiment_name == "default"
    assert ExperimentConfig().experiment_name == "default"


def test_a_mapping_is_emptied_by_braces_and_merged_otherwise():
    base = load_config(str(ARITH))
    assert base.data.task_kwargs["operators"] == ["+"] and len(base.data.task_kwargs) == 5
    merged = load_config(str(ARITH), ["data.task_kwargs={max_terms: 3}"])
    assert merged.data.task_kwargs == {**base.data.task_kwargs, "max_terms": 3}
    assert load_config(str(ARITH), ["data.task_kwargs={}"]).data.task_kwargs == {}
    again = load_config(str(ARITH), ["data.task_kwargs={}", "data.task_kwargs.max_terms=3"])
    assert again.data.task_kwargs == {"max_terms": 3}


@needs_gsm8k
def test_arith_example_switches_to_gsm8k_by_override():
    from areal_fast.launch.inputs import load_datasets

    cfg = load_config(
        str(ARITH),
        [
            "data.task=gsm8k",
            "data.task_kwargs={}",
            f"data.path={GSM8K_DIR}",
            "data.train_size=100",
            "data.eval_size=20",
        ],
    )
    train, held_out, _ = load_datasets(cfg)
    assert len(train) == 100 and len(held_out) == 20
    assert held_out[0].uid.startswith("gsm8k/test/") and train[0].uid.startswith("gsm8k/train/")


def test_total_steps_zero_names_the_eval_command():
    with pytest.raises(ConfigError) as info:
        load_config(str(ARITH), ["total_steps=0", "eval.after=false"])
    assert str(info.value).startswith("total_steps = 0 must be >= 1")
    assert "areal-fast eval --config FILE model.path=..." in str(info.value)


@needs_gsm8k
def test_gsm8k_example_fits_its_micro_batch_and_shows_the_arithmetic():
    from areal_fast.controller.requests import ChatPrompts
    from areal_fast.launch.inputs import check_lengths, load_datasets
    from areal_fast.models.loading import load_model_config, load_tokenizer

    cfg = load_config(str(GSM8K), [f"data.path={GSM8K_DIR}"])
    train, held_out, _ = load_datasets(cfg)
    assert len(train) == 7473 and len(held_out) == 200
    prompts = ChatPrompts(load_tokenizer(cfg.model.path), cfg.data.instruction)
    positions = getattr(load_model_config(cfg.model.path), "max_position_embeddings", None)
    check_lengths(cfg, prompts, train + held_out, positions)  # the example's own settings
    longest = max(len(prompts(p)) for p in train + held_out)
    need = 8 * (longest + 256)
    assert need <= cfg.actor.max_tokens_per_mb
    small = load_config(str(GSM8K), [f"data.path={GSM8K_DIR}", "actor.max_tokens_per_mb=4096"])
    with pytest.raises(ValueError) as info:
        check_lengths(small, prompts, train + held_out, positions)
    assert str(info.value) == (
        f"actor.max_tokens_per_mb = 4096 is smaller than a GRPO group (actor.keep_groups) can "
        f"be: rollout.group_size 8 × (longest prompt {longest} + rollout.max_new_tokens 256) "
        f"= {need} tokens; set actor.max_tokens_per_mb >= {need}"
    )
    one = load_config(
        str(GSM8K),
        [f"data.path={GSM8K_DIR}", "actor.max_tokens_per_mb=300", "actor.keep_groups=false"],
    )
    with pytest.raises(
        ValueError,
        match=rf"one sequence can be: longest prompt {longest} \+ "
        rf"rollout.max_new_tokens 256 = {longest + 256} ",
    ):
        check_lengths(one, prompts, train + held_out, positions)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["scheduler.ray_num_cpus=2", "scheduler.train_world_size=2"],
            "the Ray workers need 3 CPUs (scheduler.train_world_size 2 × "
            "scheduler.cpus_per_trainer_rank 1 + rollout.num_workers 1 × "
            "scheduler.cpus_per_rollout_worker 1), a local Ray instance has 2 "
            "(scheduler.ray_num_cpus)",
        ),
        (["scheduler.gpus_per_rollout_worker=1"], "GPUs"),
    ],
)
def test_ray_resources_are_checked_from_the_config(overrides, needle):
    import torch

    from areal_fast.launch.worker_specs import check_resources

    if "GPUs" in needle and torch.cuda.device_count() > 0:
        pytest.skip("this machine has a GPU")
    cfg = load_config(str(ARITH), ["scheduler.type=ray", *overrides])
    with pytest.raises(ConfigError) as info:
        check_resources(cfg)
    assert needle in str(info.value) and "\n" not in str(info.value)
    check_resources(
        load_config(
            str(ARITH),
            [
                "scheduler.type=ray",
                *overrides[:1],
                "scheduler.cpus_per_trainer_rank=0.5",
                "scheduler.cpus_per_rollout_worker=0.5",
                "scheduler.gpus_per_rollout_worker=0",
            ],
        )
    )
    # a joined cluster is checked when the launcher connects to it
    check_resources(
        load_config(str(ARITH), ["scheduler.type=ray", "scheduler.ray_address=auto", *overrides])
    )


def test_help_lists_every_key(capsys):
    from areal_fast.cli import main

    for command in ("train", "eval"):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert "areal-fast config" in out
        lines = {
            line.split(":")[0].strip(): line
            for line in out.replace("\n      ", " ").splitlines()
            if ":" in line
        }
        for section in ref.sections():
            prefix = "" if section.name == "top level" else f"{section.name}."
            listed = lines[section.name].split(":", 1)[1].replace(",", " ").split()
            assert [k.key[len(prefix) :] for k in section.keys] == listed, section.name


def test_config_command_prints_the_reference(capsys):
    from areal_fast.cli import main

    assert main(["config"]) == 0
    assert capsys.readouterr().out == ref.render_text() + "\n"
    assert main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == ref.render_markdown() + "\n"
    assert Path(REPO / "docs" / "config.md").read_text() == ref.render_markdown()
