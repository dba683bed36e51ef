"""The one engine-argument definition: vLLM's names, choices and defaults on every subcommand and on LLM."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import kimik3
from kimik3.cli import build_parser
from kimik3.config import load_config
from kimik3.engine.arg_types import human_readable_int, read_generation_config
from kimik3.engine.args import EngineArgs
from kimik3.engine.core.cache_budget import gpu_cache_budget

ENGINE_COMMANDS = ("generate", "chat", "serve", "bench")


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("text,value", [("4096", 4096), ("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600),
                                        ("1m", 1_000_000), ("1M", 1_048_576), ("2g", 2_000_000_000),
                                        (" 8K ", 8192)])
def test_human_readable_int_follows_vllm(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "abc", "32kb", ""])
def test_human_readable_int_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)


def test_every_engine_field_is_the_same_flag_on_every_command():
    subs = subparsers()
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    for command in ENGINE_COMMANDS:
        actions = {a.dest: a for a in subs[command]._actions}
        for name, f in fields.items():
            if command == "bench" and name == "model":      # bench writes a tiny checkpoint without --model
                continue
            a = actions.get(name)
            assert a is not None, f"{command} lacks --{name.replace('_', '-')}"
            assert "--" + name.replace("_", "-") in a.option_strings
            assert a.choices == f.metadata.get("choices"), (command, name)
            if not (command in ("generate", "chat") and name == "max_num_seqs"):
                assert a.default == f.default, (command, name)
    # the old spellings are gone: one name per setting
    for command in ENGINE_COMMANDS:
        flags = {s for a in subs[command]._actions for s in a.option_strings}
        assert "--no-prefix-caching" not in flags and "--cache-memory-bytes" not in flags
        assert {"--enable-prefix-caching", "--no-enable-prefix-caching"} <= flags


def test_every_flag_names_its_default():
    for command, sub in subparsers().items():
        for a in sub._actions:
            if isinstance(a, argparse._HelpAction) or not a.option_strings:
                continue
            assert a.help and "default" in a.help, f"kimik3 {command} {a.option_strings[0]}: help names no default"


def test_dtype_strings_resolve_like_vllm():
    want = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32,
            "float32": torch.float32, "float64": torch.float64, "auto": torch.float32}
    for name, dtype in want.items():
        assert EngineArgs(dtype=name, device="cpu").resolve_device_dtype() == (torch.device("cpu"), dtype)
    assert EngineArgs(dtype=torch.bfloat16, device="cpu").resolve_device_dtype()[1] is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(dtype="fp8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\], got 'fp8_e5m2'"):
        EngineArgs(kv_cache_dtype="fp8_e5m2")
    for name in ("fp8", "fp8_e4m3"):
        cfg = EngineArgs(kv_cache_dtype=name, device="cpu").engine_config(64, torch.device("cpu"))
        assert cfg.kv_cache_dtype == name
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        EngineArgs(device="tpu").resolve_device_dtype()


def test_max_model_len_defaults_to_the_model_config():
    cfg = load_config(kimik3.DEFAULT_MODEL)
    raw = json.loads((kimik3.DEFAULT_MODEL / "config.json").read_text())["text_config"]["max_position_embeddings"]
    assert EngineArgs().resolve_max_model_len(cfg) == raw
    assert EngineArgs(max_model_len="4k").resolve_max_model_len(cfg) == 4000
    with pytest.raises(ValueError, match="longer than the model's max_position_embeddings"):
        EngineArgs(max_model_len=raw + 1).resolve_max_model_len(cfg)


def test_a_cpu_default_context_a_cpu_can_serve():
    """On a CPU the default context is 8192 tokens, not the model's 1,048,576 (a chat without max_tokens could
    generate a million tokens; a 1M-id prompt grew a CPU server by 6.3 GB); a given length still wins."""
    from kimik3.engine.args import CPU_DEFAULT_MAX_MODEL_LEN
    cfg = load_config(kimik3.DEFAULT_MODEL)
    assert cfg.text.max_position_embeddings == 1048576 and CPU_DEFAULT_MAX_MODEL_LEN == 8192
    assert EngineArgs().resolve_max_model_len(cfg, torch.device("cpu")) == 8192
    assert EngineArgs(max_model_len="1M").resolve_max_model_len(cfg, torch.device("cpu")) == 1048576
    assert EngineArgs().resolve_max_model_len(cfg, torch.device("cuda")) == 1048576
    llm = kimik3.LLM(kimik3.DEFAULT_MODEL, device="cpu", max_num_seqs=2)
    assert llm.engine.config.max_model_len == 8192


def test_gpu_memory_utilization_is_a_fraction_of_the_whole_gpu():
    gib = 1 << 30
    # 80 GiB GPU, weights hold 30 GiB, nobody else: 0.9 * 80 - 30 = 42 GiB of cache
    assert gpu_cache_budget(80 * gib, 50 * gib, 30 * gib, 0.9) == int(0.9 * 80 * gib) - 30 * gib
    with pytest.raises(ValueError, match="only 20.00 GiB of the GPU is free"):   # another process holds 30 GiB
        gpu_cache_budget(80 * gib, 20 * gib, 30 * gib, 0.9)
    with pytest.raises(ValueError, match="the weights already take"):
        gpu_cache_budget(80 * gib, 10 * gib, 70 * gib, 0.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization must lie in"):
        EngineArgs(gpu_memory_utilization=1.5)


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7, "do_sample": True}))
    assert read_generation_config(tmp_path, "auto") == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                        "max_tokens": 7}
    assert read_generation_config(tmp_path, "vllm") == {}
    other = tmp_path / "other"
    other.mkdir()
    assert read_generation_config(other, "auto") == {}
    assert read_generation_config(other, str(tmp_path))["temperature"] == 0.6
    with pytest.raises(ValueError, match="no generation_config.json there"):
        read_generation_config(tmp_path, str(other))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature must be a number"):
        read_generation_config(tmp_path, "auto")


def test_limit_mm_per_prompt_is_checked():
    assert EngineArgs(limit_mm_per_prompt={"image": 2}).limit_mm_per_prompt == {"image": 2}
    with pytest.raises(ValueError, match="unknown modality 'audio'"):
        EngineArgs(limit_mm_per_prompt={"audio": 1})
    args = subparsers()["serve"].parse_args(["--limit-mm-per-prompt", '{"image": 3, "video": 0}'])
    assert EngineArgs.from_cli(args).limit_mm_per_prompt == {"image": 3, "video": 0}


@pytest.mark.parametrize("flags, expected", [
    ([], False), (["-tp", "2"], True), (["--enable-expert-parallel"], True),     # graphs under TP: opt-in
    (["-tp", "2", "--no-enforce-eager"], False), (["--enforce-eager"], True),
])
def test_enforce_eager_defaults_to_graphs_on_one_gpu_only(flags, expected):
    from kimik3.engine.flags import add_engine_args
    ns = add_engine_args(argparse.ArgumentParser()).parse_args(flags)
    args = EngineArgs(**{k: v for k, v in vars(ns).items() if k in EngineArgs.__dataclass_fields__})
    assert args.engine_config(64, torch.device("cuda")).enforce_eager is expected


@pytest.mark.parametrize("flags, device, flash, expected", [
    ([], "cpu", False, 16), ([], "cuda", False, 16), ([], "cpu", True, 16),
    ([], "cuda", True, 64),                                  # FlashMLA named on CUDA: its 64-token blocks
    (["--block-size", "32"], "cuda", True, 32), (["--block-size", "32"], "cuda", False, 32),
])
def test_block_size_follows_flash_mla_unless_given(flags, device, flash, expected):
    from kimik3.engine.flags import add_engine_args
    flags = flags + (["--flash-mla", "/nowhere/libkimik3_flash_mla.so"] if flash else [])  # only named: never loaded
    ns = add_engine_args(argparse.ArgumentParser()).parse_args(flags)
    args = EngineArgs(**{k: v for k, v in vars(ns).items() if k in EngineArgs.__dataclass_fields__})
    assert args.engine_config(64, torch.device(device)).block_size == expected


def test_kernel_options_from_flags_else_their_variables(monkeypatch):
    """Each kernel flag resolves into ``KernelOptions``; where a flag is not given its environment variable
    (read in EngineArgs alone) is the fallback, and a given flag wins over it."""
    from kimik3.engine.flags import add_engine_args
    from kimik3.ops.options import KernelOptions

    def options(flags):
        ns = add_engine_args(argparse.ArgumentParser()).parse_args(flags)
        return EngineArgs(**{k: v for k, v in vars(ns).items() if k in EngineArgs.__dataclass_fields__}).kernel_options()
    for name in ("KIMIK3_FLASH_MLA", "KIMIK3_FLASH_KDA", "KIMIK3_PDL", "KIMIK3_PREFETCH"):
        monkeypatch.delenv(name, raising=False)
    assert options([]) == KernelOptions()
    assert options(["--flash-mla", "/a.so", "--flash-kda", "/b.so", "--no-pdl", "--no-prefetch"]) == \
        KernelOptions(flash_mla="/a.so", flash_kda="/b.so", pdl=False, prefetch=False)
    monkeypatch.setenv("KIMIK3_FLASH_MLA", "/env.so")
    monkeypatch.setenv("KIMIK3_PDL", "0")
    assert options([]) == KernelOptions(flash_mla="/env.so", pdl=False)
    assert options(["--flash-mla", "/flag.so", "--pdl"]) == KernelOptions(flash_mla="/flag.so", pdl=True)


def test_the_gpu_cache_budget_leaves_a_steps_workspace():
    """The cache is sized after the worst step's workspace is set aside (a K3 slice with max_model_len 1M at
    gpu_memory_utilization 0.9 ran out of memory prefilling 131,072 tokens: the plan had left only the 10 %)."""
    from kimik3.config import load_config
    from kimik3.engine.config import EngineConfig
    from kimik3.engine.core.cache_budget import GRAPH_RESERVE, step_workspace
    from kimik3.engine.core.scheduler import PROMPT_LOGPROB_ROWS
    gib = 1 << 30
    text = load_config(Path(__file__).parents[1] / "data/kimi-k3-release.config.json").text
    ws = step_workspace(text, EngineConfig(max_model_len=1048576), torch.bfloat16)
    assert set(ws.parts) == {"residual", "mla", "kda", "mlp", "logits", "graphs"} and ws.parts["graphs"] == GRAPH_RESERVE
    # the logits part from the vocabulary: 64 samples + 1024 scored prompt positions, float32, logits + log-softmax
    assert ws.parts["logits"] == (64 + PROMPT_LOGPROB_ROWS) * text.vocab_size * 4 * 2
    # every part is O(chunk): the context length does not grow it (the MLA prefill walks the context in pieces)
    assert step_workspace(text, EngineConfig(max_model_len=131072), torch.bfloat16).total == ws.total
    half = step_workspace(text, EngineConfig(max_model_len=1048576, max_num_batched_tokens=4096), torch.bfloat16)
    assert half.total < ws.total and half.parts["kda"] * 2 == ws.parts["kda"]
    assert step_workspace(text, EngineConfig(enforce_eager=True), torch.bfloat16).parts["graphs"] == 0
    budget = gpu_cache_budget(80 * gib, 78 * gib, 30 * gib, 0.9, ws.total)
    assert budget == int(0.9 * 80 * gib) - 30 * gib - ws.total
    with pytest.raises(ValueError, match="workspace .* lower max_num_batched_tokens"):
        gpu_cache_budget(80 * gib, 78 * gib, 60 * gib, 0.9, ws.total)


def test_long_prefill_threshold_and_cpu_threads():
    """--long-prefill-token-threshold (vLLM's; off by default) reaches the engine config; --cpu-threads sets torch's
    threads on a CPU device (None leaves torch's default); bad values are refused naming the argument."""
    assert EngineArgs().engine_config(1024, torch.device("cpu")).long_prefill_token_threshold == 0
    assert EngineArgs(long_prefill_token_threshold=32).engine_config(
        1024, torch.device("cpu")).long_prefill_token_threshold == 32
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        EngineArgs(cpu_threads=0)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be a non-negative integer"):
        EngineArgs(long_prefill_token_threshold=-1).engine_config(1024, torch.device("cpu"))
    before = torch.get_num_threads()
    try:
        llm = kimik3.LLM(kimik3.DEFAULT_MODEL, device="cpu", max_num_seqs=2, cpu_threads=1)
        assert torch.get_num_threads() == 1 and llm.engine.config.long_prefill_token_threshold == 0
    finally:
        torch.set_num_threads(before)


EAGLE3 = {"method": "eagle3", "model": "default", "num_speculative_tokens": 2}


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=2, enable_eplb=True), "add enable_expert_parallel"),
    (dict(tensor_parallel_size=2, num_redundant_experts=2), "need enable_eplb"),
    (dict(enable_expert_parallel=True, enable_eplb=True), "set tensor_parallel_size > 1"),
    (dict(pipeline_parallel_size=2, enable_expert_parallel=True, enable_eplb=True), "set tensor_parallel_size > 1"),
    (dict(pipeline_parallel_size=2, async_scheduling=True), "async_scheduling is not supported with pipeline"),
    (dict(pipeline_parallel_size=2, enforce_eager=False), "leave enforce_eager on"),
    (dict(pipeline_parallel_size=2, speculative_config=EAGLE3), "'eagle3' .* use n-gram drafts"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 1}), "'mtp'"),
    (dict(pp_micro_batches=2), "need pipeline_parallel_size > 1"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=4), "must divide tensor_parallel_size 2"),
])
def test_layouts_the_engine_cannot_run_are_refused_naming_the_fix(kwargs, match):
    """Combinations of the parallel flags that kimik3 does not run are refused when the arguments are built (before
    any rank starts), each naming what to change; n-gram speculation under pipeline parallelism is taken."""
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs)
    EngineArgs(pipeline_parallel_size=2, num_speculative_tokens=2)
    EngineArgs(pipeline_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
               speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("flag,value,named", [
    ("--speculative-config", '{"method": "eagle3", "model": "default", "num_speculative_tokens": 4, "bogus": 1}',
     "unknown key(s) ['bogus']"),
    ("--speculative-config", '{"method": "eagle3", "model": "default", "num_speculative_tokens": 4, '
     '"num_speculative_tokens_per_batch_size": [[1, 512, 0, 100, 4]]}', "five-item entries"),
    ("--speculative-config", '{"method": "eagle3"', "expected JSON such as"),
    ("--limit-mm-per-prompt", '{"audio": 1}', "unknown modality 'audio'"),
])
def test_json_flags_name_what_is_wrong(flag, value, named, capsys):
    """A JSON flag's own check reaches the command line's error (argparse would hide a ValueError behind
    "invalid speculative_config_arg value")."""
    with pytest.raises(SystemExit):
        subparsers()["generate"].parse_args([flag, value])
    assert named in capsys.readouterr().err
