"""`kumo eval` on a tiny Kimi-K2-shaped model with a byte-level tokenizer.

The first variant's answers are checked against transformers' own model of the same checkpoint
(the task files' gold answers are what transformers picks or generates, so the reference variant
must score 1.0), a variant identical to the first must show zero KL, full agreement and a zero
difference, and quantized variants must show a small, non-zero KL.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from backend.tools.eval import main
from backend.tools.quantize import main as quantize
from tests.backend.conformance import reference_greedy, reference_logits
from tests.backend.tiny_checkpoints import load_reference, make_tiny

QUESTIONS = ["Capital of France?", "2 + 2 =", "Colour of the sky:", "Opposite of hot:", "First letter:"]
CHOICES = [
    ["Paris", "Rome", "Oslo"],
    ["4", "5", "22"],
    ["blue", "green"],
    ["cold", "warm", "odd"],
    ["a", "b", "z"],
]
PROMPTS = ["Once upon a time", "def f(x):", "Q: 7*6? A:"]
TEXT = "The quick brown fox jumps over the lazy dog. " * 4


def _byte_tokenizer(path: Path) -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    return tok


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("eval")
    src = make_tiny("kimi_k2", root / "src", initializer_range=0.02)
    tok = _byte_tokenizer(src)
    ref = load_reference("kimi_k2", src)
    mc = []
    for q, choices in zip(QUESTIONS, CHOICES, strict=True):
        qi = tok.encode(q).ids
        scores = []
        for c in choices:
            ids = qi + tok.encode(" " + c).ids
            lp = F.log_softmax(reference_logits(ref, ids)[len(qi) - 1 : -1], -1)
            scores.append(float(lp.gather(1, torch.tensor(ids[len(qi) :])[:, None]).sum()))
        mc.append({"question": q, "choices": choices, "answer": int(torch.tensor(scores).argmax())})
    (root / "mc.jsonl").write_text("\n".join(json.dumps(x) for x in mc))
    gen = []
    for p in PROMPTS:
        out = reference_greedy(ref, tok.encode(p).ids, 6)
        out = out[
            : next((i for i, t in enumerate(out) if t in (1, 2)), len(out))
        ]  # generation_config eos [1, 2]
        gen.append({"prompt": p, "answer": tok.decode(out)})
    (root / "gen.jsonl").write_text("\n".join(json.dumps(x) for x in gen))
    (root / "text.txt").write_text(TEXT)
    dst = root / "int4"
    quantize([str(src), str(dst), "--weights", "int4-g32", "--all-linear"])
    return src, dst, root


def test_eval_two_variants_against_transformers(
    setup: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    src, dst, root = setup
    out = root / "report.json"
    args = [
        "--variant",
        f"ref={src}",
        "--variant",
        f"same={src}:device=cpu",  # the device option (on a GPU machine: the CPU path beside CUDA)
        "--variant",
        f"int4={dst}",
        "--variant",
        f"fp8kv={src}:kv=fp8",
        "--data",
        str(root / "mc.jsonl"),
        "--data",
        str(root / "gen.jsonl"),
        "--text",
        str(root / "text.txt"),
        "--max-new-tokens",
        "6",
        "--window",
        "64",
        "--out",
        str(out),
    ]
    with caplog.at_level(logging.WARNING):
        assert main(args) == 0
    assert any("no FP8 KV-cache scales" in r.getMessage() for r in caplog.records)
    report = json.loads(out.read_text())
    tasks = {t["task"]: {r["variant"]: r for r in t["results"]} for t in report["tasks"]}
    assert set(tasks) == {"mc", "mc:norm", "gen", "text"}
    for task in ("mc", "gen"):
        assert tasks[task]["ref"]["accuracy"] == 1.0  # transformers' own picks and generations
        same = tasks[task]["same"]
        assert same["mean_kl"] == 0.0 and same["top1_agreement"] == 1.0
        assert same["delta_vs_first"] == 0.0 and same["delta_ci"] == [0.0, 0.0]
        lo, hi = tasks[task]["int4"]["delta_ci"]
        assert lo <= tasks[task]["int4"]["delta_vs_first"] <= hi
    for variant, bound in (("int4", 0.05), ("fp8kv", 0.01)):
        kl = tasks["text"][variant]["mean_kl"]
        assert 0 < kl < bound, (variant, kl)
    assert tasks["text"]["fp8kv"]["mean_kl"] < tasks["text"]["int4"]["mean_kl"]

    ref = load_reference("kimi_k2", src)
    ids = Tokenizer.from_file(str(src / "tokenizer.json")).encode(TEXT).ids
    nll, n = 0.0, 0
    for i in range(0, len(ids) - 1, 64):
        w = ids[i : i + 64]
        lp = F.log_softmax(reference_logits(ref, w)[:-1], -1)
        nll -= float(lp.gather(1, torch.tensor(w[1:])[:, None]).sum())
        n += len(w) - 1
    assert tasks["text"]["ref"]["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)


@pytest.mark.parametrize(
    ("kind", "call"),
    [
        (
            "kimi-k2.6",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>',
        ),
        (
            "glm-5.2",
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        ),
    ],
)
def test_tool_call_scoring_with_the_family_parser(kind: str, call: str, tmp_path: Path) -> None:
    """The output is read as serving reads it (reasoning split, the family's parser on the content):
    a call written inside the reasoning block is a call too (its opening marker ends the block, as
    Kimi K2 Thinking and GLM-5 call tools while reasoning), a call's name or value wrong is none."""
    from backend.engine.prompt_runner import Generated
    from backend.tools.eval_prompts import EvalPrompts
    from backend.tools.eval_tasks import ExpectedCall, ToolItem, call_matches
    from backend.tools.random_checkpoint import write_random_checkpoint
    from schemas.backend import Message, Tool

    path = write_random_checkpoint(kind, tmp_path / "ckpt")
    prompts = EvalPrompts([path], is_chat=True, max_new_tokens=64, dtype=torch.float32, devices=["cpu"])
    tok = prompts.tokenizer
    weather = Tool(
        name="get_weather",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    )
    item = ToolItem(
        messages=[Message(role="user", content="Weather in Paris for 2 days?")],
        tools=[weather],
        expected=ExpectedCall(name="get_weather", arguments={"city": "Paris", "days": 2}),
    )
    stop = sorted(prompts.stop_ids)[0]

    def calls(text: str) -> list:  # type: ignore[type-arg]
        (request,) = prompts.generation(item)  # a fresh request: its output processor holds state
        return prompts.read(request, Generated(tok.encode(text, allow_special=True), stop)).calls

    assert call_matches(calls("Let me check.</think>" + call), item.expected)
    assert not call_matches(
        calls("Let me check.</think>" + call),
        ExpectedCall(name="get_weather", arguments={"city": "Rome", "days": 2}),
    )
    assert call_matches(calls(call + "</think>It is sunny."), item.expected)
    assert call_matches(calls("Let me check. " + call), item.expected)  # the block never closed
    assert not call_matches(calls("</think>It is sunny in Paris."), item.expected)


def test_tool_call_task_runs_through_the_chat_template(tmp_path: Path) -> None:
    """A Kimi-tokenizer tiny model: the task renders, generates and scores for every variant."""
    from backend.text.tokenizer_files import write_tokenizer_files

    src = make_tiny(
        "kimi_k2", tmp_path / "src", initializer_range=0.02, vocab_size=833, max_position_embeddings=512
    )
    write_tokenizer_files("kimi", src, fmt="tokenizer.json")
    item = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [
            {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            }
        ],
        "expected": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    (tmp_path / "tools.jsonl").write_text(json.dumps(item))
    out = tmp_path / "r.json"
    args = [
        "--variant",
        f"a={src}",
        "--variant",
        f"b={src}:weights=int4-g32",
        "--data",
        str(tmp_path / "tools.jsonl"),
        "--max-new-tokens",
        "4",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    (task,) = json.loads(out.read_text())["tasks"]
    assert task["kind"] == "tool_call" and task["num_items"] == 1
    # a random model calls no tool: both score 0, and the INT4 variant still differs in distribution
    assert [r["accuracy"] for r in task["results"]] == [0.0, 0.0]
    assert task["results"][1]["mean_kl"] > 0


def test_variant_options_are_checked_before_anything_loads() -> None:
    """A mistyped option used to be ignored (`weight=int4-g32` ran the variant unquantized and
    reported it identical to the reference) and `weights=fp8` quantized experts as FP8 blocks."""
    from backend.tools.eval import VariantOptions, parse_variant

    assert parse_variant("ckpt") == ("ckpt", VariantOptions())
    assert parse_variant("d:weights=int4-g128:kv=fp8:all-linear") == (
        "d",
        VariantOptions(kv="fp8", weights="int4-g128", all_linear=True),
    )
    assert parse_variant("d:kv=fp8:device=cpu") == ("d", VariantOptions(kv="fp8", device="cpu"))
    assert parse_variant("d:kv=fp8:mla=fp8-dot") == ("d", VariantOptions(kv="fp8", mla="fp8-dot"))
    for spec, word in (
        ("d:weight=int4-g32", "weight"),
        ("d:weights=fp8", "fp8"),
        ("d:weights=int4-g64", "int4-g64"),
        ("d:kv=fp16", "fp16"),
        ("d:all-linear", "all-linear"),
        ("d:device=tpu", "device=tpu"),
        ("d:mla=fp8-dot", "kv=fp8"),  # the FP8-dot path reads an FP8 cache: with BF16 it would not run
        ("d:kv=fp8:mla=fp8", "mla=fp8"),
    ):
        with pytest.raises(ValueError, match=word):
            parse_variant(spec)


@pytest.mark.parametrize(
    "variants",
    [["a=x", "a=y"], ["a=x", "bdir"], ["a=x", "b=y:weights=int4"]],
    ids=["duplicate", "no-name", "bad"],
)
def test_cli_refuses_bad_variant_lists(
    variants: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "t.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    args = [a for v in variants for a in ("--variant", v)]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--data", str(data)])
    assert exc.value.code == 2
    assert "variant" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line, words",
    [
        ('{"question": "q", "choices": ["a", "b"], "answer": 2}', ["line 2", "answer 2", "2 choices"]),
        ('{"question": "q", "choices": ["a", "b"], "answer": -1}', ["line 2", "answer -1"]),
        ('{"question": "q", "choices": [], "answer": 0}', ["line 2", "choices"]),
        ('{"prompt": "p", "answer": "1", "answer_regex": "(unclosed"}', ["line 2", "answer_regex"]),
    ],
)
def test_task_items_are_checked_at_load(tmp_path: Path, line: str, words: list[str]) -> None:
    """An out-of-range answer index was silently scored wrong for every variant (a biased accuracy);
    a bad regex raised re.error from deep inside generation."""
    from backend.tools.eval_tasks import load_items

    first = line.replace('"answer": 2', '"answer": 0').replace('"answer": -1', '"answer": 0')
    first = first.replace('"choices": []', '"choices": ["a"]').replace("(unclosed", "(\\\\d+)")
    path = tmp_path / "t.jsonl"
    path.write_text(first + "\n" + line + "\n")
    with pytest.raises(ValueError) as exc:
        load_items(path)
    for word in words:
        assert word in str(exc.value)


def test_answer_regex_whose_group_did_not_match_is_no_crash() -> None:
    from backend.tools.eval_tasks import GenItem, extract_answer

    item = GenItem(prompt="p", answer="7", answer_regex=r"answer is (\d+)|####")
    assert extract_answer("#### 7", item) == ""
    assert extract_answer("the answer is 7", item) == "7"


def _bare_evaluator(names: list[str]):  # type: ignore[no-untyped-def]
    from backend.tools.eval import Evaluator

    ev = object.__new__(Evaluator)
    ev.variants = [type("V", (), {"name": n})() for n in names]  # type: ignore[assignment]
    ev.generator = torch.Generator().manual_seed(0)
    return ev


def test_accuracy_intervals_are_binomial_sized_and_the_delta_is_paired() -> None:
    """Half of 400 right: the 95% interval is about ±1.96·√(¼/400) = ±0.049; a variant that differs
    from the first on 4 items has a paired Δ interval far narrower than two unpaired ones would give."""
    first = torch.zeros(400, dtype=torch.bool)
    first[::2] = True
    other = first.clone()
    other[[1, 3, 5, 7]] = True  # +4 right, no item lost
    res = _bare_evaluator(["a", "b"])._results([first, other], [0.0, 0.0], [0.0, 0.0], 1)
    lo, hi = res[0].accuracy_ci
    assert res[0].accuracy == 0.5 and 0.04 < 0.5 - lo < 0.06 and 0.04 < hi - 0.5 < 0.06
    assert res[1].delta_vs_first == pytest.approx(0.01)
    dlo, dhi = res[1].delta_ci
    assert 0.0 <= dlo <= 0.01 <= dhi <= 0.025  # paired: every resample gains 0..4 items, never loses
    assert res[0].delta_vs_first == 0.0 and res[0].delta_ci == (0.0, 0.0)


def test_multiple_choice_pick_summed_and_length_normalised() -> None:
    """Summed log-likelihood favours short choices; the normalised pick (lm-evaluation-harness's
    acc_norm: per byte of the choice) does not."""
    from backend.tools.eval import pick_choice

    loglik = torch.tensor([-6.0, -9.0])  # a 2-byte choice, then a 12-byte one
    assert pick_choice(loglik, [2, 12], normalise=False) == 0
    assert pick_choice(loglik, [2, 12], normalise=True) == 1


def test_cli_errors_are_one_line_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "t.jsonl"
    data.write_text('{"question": "q", "choices": ["a"], "answer": 3}\n')
    assert main(["--variant", "a=x", "--variant", "b=y", "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert "kumo eval: error:" in err and "line 1" in err


def test_fp8_kv_scales_of_an_in_memory_quantized_variant_come_from_the_unquantized_model(
    tmp_path: Path,
) -> None:
    """As `kumo quantize --kv-scales` calibrates on the source model, so does the variant that
    tries the format in memory (it calibrated on its already-quantized weights)."""
    from backend.models.loader import load_model
    from backend.quant import kv_scales
    from backend.tools.eval import Variant

    src = make_tiny("kimi_k2", tmp_path / "src", initializer_range=0.02)
    variant = Variant("q", f"{src}:weights=int4-g32:all-linear:kv=fp8")
    plain = load_model(src, dtype=torch.float32)
    expected = kv_scales.scales_for_serving(
        src, plain.model, model_dtype=torch.float32, vocab_size=plain.config.vocab_size
    )
    assert variant.scales == expected


def test_mla_fp8_dot_variant_switches_every_mla_layer_on_cuda_only(tmp_path: Path) -> None:
    """`mla=fp8-dot` sets each MLA layer's `fp8_dot` (what `kernels.mla_attention` reads) and is
    refused off CUDA, where the op has only the exact reference."""
    from backend.models.deepseek_v3 import MLAAttention, set_mla_fp8_dot
    from backend.models.loader import load_model
    from backend.tools.eval import Variant

    src = make_tiny("kimi_k2", tmp_path / "src", initializer_range=0.02)
    with pytest.raises(ValueError, match="only on CUDA"):
        Variant("d", f"{src}:kv=fp8:mla=fp8-dot")
    model = load_model(src, dtype=torch.float32).model
    layers = [m for m in model.modules() if isinstance(m, MLAAttention)]
    assert layers and not any(m.fp8_dot for m in layers)
    assert set_mla_fp8_dot(model, True) == len(layers) and all(m.fp8_dot for m in layers)
