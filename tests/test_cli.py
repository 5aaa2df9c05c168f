"""The kvzip-jax command, run in-process: bad input exits 2 with one line; compress and head-scores end to end on
SmolLM2 with a tiny context (the model is restored once per module; registry.load itself is tested elsewhere)."""

import dataclasses
import html
import io
import json
import re

import pytest

from kvzip_jax import cli, prompts
from kvzip_jax.models.params import init_params
from kvzip_jax.weights import registry
from tests.conftest import _checkpoints_dir, tiny_config

CONTEXT = (
    "The survey team left Longyearbyen on the fourth of May. The helicopter that evacuated the injured "
    "glaciologist was piloted by Ingrid Solberg. The backup ice-core drill travelled in crate K-4471. The "
    "complete results will be presented in Trondheim next spring."
)
QUESTION = "Who piloted the helicopter?"


@pytest.fixture(scope="module")
def smollm2_checkpoint(smollm2_gguf):
    """The converted SmolLM2 checkpoint folder (converted once if absent)."""
    return registry.converted(registry.SMOLLM2, _checkpoints_dir())


@pytest.fixture(scope="module")
def restored(smollm2_checkpoint):
    return registry.load(smollm2_checkpoint)


@pytest.fixture
def smollm2(monkeypatch, smollm2_checkpoint, restored):
    """The checkpoint folder; the CLI's registry.load returns the SmolLM2 restored once for this module."""
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": restored)
    return smollm2_checkpoint


@pytest.fixture
def context_file(tmp_path):
    path = tmp_path / "context.txt"
    path.write_text(CONTEXT)
    return path


def _fails_with_one_line(capsys, argv, *fragments):
    assert cli.main(argv) == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvzip-jax {argv[0]}: error: "), err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("ratio", ["0", "1.5", "-0.2"])
def test_a_ratio_outside_zero_one_exits_2(capsys, context_file, ratio):
    _fails_with_one_line(
        capsys,
        ["compress", "--model", registry.SMOLLM2, "--context", str(context_file), "--ratio", ratio],
        "ratio",
        "(0, 1]",
    )


def test_a_missing_or_empty_context_file_exits_2(capsys, tmp_path):
    missing = tmp_path / "absent.txt"
    _fails_with_one_line(
        capsys,
        ["compress", "--model", registry.SMOLLM2, "--context", str(missing), "--ratio", "0.3"],
        "context file",
        str(missing),
    )
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n")
    _fails_with_one_line(
        capsys, ["compress", "--model", registry.SMOLLM2, "--context", str(empty), "--ratio", "0.3"], "empty"
    )


def test_a_malformed_questions_file_exits_2(capsys, context_file, tmp_path):
    questions = tmp_path / "questions.json"
    questions.write_text('[{"q": "no question key"}]')
    _fails_with_one_line(
        capsys,
        [
            "compress",
            "--model",
            registry.SMOLLM2,
            "--context",
            str(context_file),
            "--ratio",
            "0.3",
            "--questions",
            str(questions),
        ],
        "JSON list",
    )


def test_level_head_without_head_scores_says_to_run_head_scores_first(capsys, context_file, tmp_path):
    _fails_with_one_line(
        capsys,
        ["compress", "--model", str(tmp_path), "--context", str(context_file), "--ratio", "0.5", "--level", "head"],
        f"kvzip-jax head-scores --model {tmp_path}",
    )


def test_an_empty_instruction_exits_2_before_loading_the_model(capsys, monkeypatch, context_file):
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "compress",
                "--model",
                registry.SMOLLM2,
                "--context",
                str(context_file),
                "--ratio",
                "0.3",
                "--instruction",
                " ",
            ]
        )
    assert exit_info.value.code == cli.EXIT_USER_ERROR
    assert "--instruction is empty" in capsys.readouterr().err


def test_compress_answers_from_the_compressed_cache(capsys, smollm2, restored, context_file, tmp_path):
    questions = tmp_path / "questions.json"
    questions.write_text(json.dumps([{"question": "Which crate held the backup drill?", "answer": "K-4471"}]))
    argv = [
        "compress",
        "--model",
        str(smollm2),
        "--context",
        str(context_file),
        "--ratio",
        "0.5",
        "--question",
        QUESTION,
        "--questions",
        str(questions),
        "--max-new-tokens",
        "12",
        "--chunk-size",
        "64",
        "--instruction",
        "kvzip",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    context, _ = prompts.split_for_reuse(restored.tokenizer, CONTEXT, [], instruction=prompts.KVZIP_INSTRUCTION)
    assert f"({context.context_start} prefix + " in out  # KVzip's instruction sits in the never-evicted prefix
    assert "prefill:" in out and "kvzip (KVzip, arXiv 2505.23416, pair level) at ratio 0.5: context pairs scored" in out
    assert out.count("\nA: ") == 2 and f"Q: {QUESTION}\nA: " in out and "Q: Which crate" in out
    assert "tokens in" in out
    assert "KV cache bytes: full " in out and "KV cache bytes: compressed " in out and "allocated" in out
    kept_line = next(line for line in out.splitlines() if line.startswith("tokens kept: "))
    kept, total = (int(x) for x in kept_line.split()[2:5:2])
    assert kept == total // 2  # floor(0.5 x context pairs), exactly


@pytest.fixture
def tiny(monkeypatch, restored):
    """A tiny random model (2 layers, 2 KV heads, head dim 8) with SmolLM2's tokenizer, as the CLI's model."""
    cfg = tiny_config(2)
    cfg = dataclasses.replace(cfg, vocab_size=restored.cfg.vocab_size)
    model = dataclasses.replace(restored, cfg=cfg, params=init_params(cfg, seed=1, scale=0.15))
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": model)
    return model


def test_compress_refuses_what_cannot_fit_before_allocating(capsys, tiny, context_file, monkeypatch):
    from kvzip_jax import generate as gen
    from kvzip_jax.sharding import memory

    monkeypatch.setattr(memory, "device_memory", lambda: 64 << 10)  # a 64 KiB device
    monkeypatch.setattr(gen, "prefill", lambda *a, **k: pytest.fail("the cache was allocated"))
    _fails_with_one_line(
        capsys,
        ["compress", "--model", "tiny", "--context", str(context_file), "--ratio", "0.3", "--question", QUESTION],
        "GiB per device (params 0.00, cache",
        "largest part",
    )


@pytest.mark.parametrize("method, flags", [("am-hak", []), ("kvzip-am-op", ["--self-study"])])
def test_compress_by_attention_matching_answers_and_reports_kept_pairs_and_bytes(
    capsys, tiny, context_file, method, flags
):
    argv = [
        "compress",
        "--model",
        "tiny",
        "--context",
        str(context_file),
        "--ratio",
        "0.3",
        "--method",
        method,
        "--question",
        QUESTION,
        "--max-new-tokens",
        "4",
        "--chunk-size",
        "64",
        *flags,
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"{method} (Attention Matching, arXiv 2602.16284) at ratio 0.3: keys selected, their values and a " in out
    assert out.count("\nA: ") == 1 and f"Q: {QUESTION}\nA: " in out
    kept_line = next(line for line in out.splitlines() if line.startswith("tokens kept: "))
    kept, total = (int(x) for x in kept_line.split()[2:5:2])
    assert 0 < kept < 0.3 * total  # same bytes: a few pairs fewer than KVzip's floor(0.3 x pairs), for the bias
    assert "KV cache bytes: full " in out and "KV cache bytes: compressed " in out
    # the bias is counted: every kept pair costs 2 x 8 x 4 + 4 bytes in float32 (the prefix's pairs too)
    filled = lambda name: int(
        next(line for line in out.splitlines() if line.startswith(f"KV cache bytes: {name}"))
        .split()[4]
        .replace(",", "")
    )
    full_pairs = filled("full") // (2 * 8 * 4)
    assert filled("compressed") == (full_pairs - (total - kept)) * (2 * 8 * 4 + 4)


@pytest.mark.parametrize("flags", [["--level", "pair"], ["--level", "head", "--sink", "4"]])
def test_a_method_refuses_options_it_does_not_have(capsys, monkeypatch, context_file, flags):
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "compress",
                "--model",
                registry.SMOLLM2,
                "--context",
                str(context_file),
                "--ratio",
                "0.3",
                "--method",
                "kvzip-am",
                *flags,
            ]
        )
    assert exit_info.value.code == cli.EXIT_USER_ERROR
    assert "--level is an option of kvzip; --method kvzip-am has none" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--decode-budget", "64"], "--decode-budget scores with a trained scorer (fast-kvzip, kvzap), not kvzip"),
        (["--method", "kvzap", "--decode-budget", "64", "--kv-bits", "8"], "no --save, no --kv-bits"),
        (["--method", "kvzap", "--decode-budget", "64", "--save", "x.kv"], "no --save, no --kv-bits"),
        (["--method", "kvzap", "--decode-budget", "0"], "--decode-budget must be >= 1, got 0"),
    ],
)
def test_decode_budget_flags_that_do_not_go_together_exit_2_before_loading(
    capsys, monkeypatch, context_file, flags, fragment
):
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": pytest.fail("the model was loaded"))
    argv = ["compress", "--model", registry.SMOLLM2, "--context", str(context_file), "--ratio", "0.3", *flags]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == cli.EXIT_USER_ERROR and fragment in capsys.readouterr().err


def test_self_study_needs_a_method_that_reads_reference_queries(capsys, monkeypatch, context_file):
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit):
        cli.main(
            ["compress", "--model", registry.SMOLLM2, "--context", str(context_file), "--ratio", "0.3", "--self-study"]
        )
    assert "--self-study adds reference queries; --method kvzip reads none" in capsys.readouterr().err


def test_head_scores_then_compress_at_the_head_level_from_stdin(capsys, monkeypatch, smollm2, tmp_path):
    model = tmp_path / "smollm2"  # a checkpoint folder of links, so head_scores.json lands in tmp_path
    model.mkdir()
    for entry in smollm2.iterdir():
        if entry.name != "head_scores.json":
            (model / entry.name).symlink_to(entry)
    argv = ["head-scores", "--model", str(model), "--tokens", "96", "--chunk-size", "128"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "head scores [30, 3]" in out and "from 96 sample tokens" in out and "median" in out
    assert json.loads((model / "head_scores.json").read_text())["tokens"] == 96
    _fails_with_one_line(capsys, argv, "already exists", "--overwrite")

    context = tmp_path / "context.txt"
    context.write_text(CONTEXT)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{QUESTION}\n\n"))
    argv = [
        "compress",
        "--model",
        str(model),
        "--context",
        str(context),
        "--ratio",
        "0.4",
        "--level",
        "head",
        "--sink",
        "4",
        "--recent",
        "8",
        "--max-new-tokens",
        "8",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "from saved head scores, no scoring pass" in out and "questions from stdin" in out
    assert out.count("\nA: ") == 1 and f"Q: {QUESTION}\nA: " in out


@pytest.mark.extended  # the CLI sweep, its report and its resume run in test_eval_distributed (tiny model, faster)
def test_eval_sweeps_writes_the_report_and_resumes(capsys, smollm2, tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text(
        json.dumps(
            {
                "context": CONTEXT,
                "queries": [QUESTION, "Which crate held the backup drill?"],
                "answers": ["Ingrid Solberg", "K-4471"],
                "max_new_tokens": 10,
            }
        )
        + "\n"
    )
    out = tmp_path / "run"
    argv = [
        "eval",
        "--model",
        str(smollm2),
        "--tasks",
        "passkey",
        "--contexts",
        "1",
        "--context-tokens",
        "120",
        "--questions-per-context",
        "2",
        "--jsonl",
        str(records),
        "--methods",
        "kvzip,snapkv",
        "--ratios",
        "1,0.3",
        "--batch-size",
        "2",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    lines = (out / "results.jsonl").read_text().splitlines()
    # 2 contexts x 2 questions x (full + 2 methods x 2 ratios)
    assert len(lines) == 2 * 2 * (1 + 2 * 2)
    assert {json.loads(line)["task"] for line in lines} == {"passkey", "records"}
    for name in ("summary.md", "summary.csv", "scores.png"):
        assert (out / name).stat().st_size > 0
    assert "| passkey | kvzip | reuse |" in printed and "| records | snapkv | reuse |" in printed
    assert cli.main(argv) == 0  # a finished sweep: nothing redone, nothing appended
    assert (out / "results.jsonl").read_text().splitlines() == lines


@pytest.mark.parametrize(
    "flag, value, fragment",
    [
        ("--methods", "kvzip,magic", "unknown method"),
        ("--ratios", "0.5,1.5", "ratio"),
        ("--tasks", "haystacks", "unknown task"),
        ("--modes", "sometimes", "modes"),
        ("--ratios", "half", "--ratios"),
    ],
)
def test_eval_refuses_bad_choices_before_loading_the_model(capsys, monkeypatch, flag, value, fragment):
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "--model", registry.SMOLLM2, flag, value])
    assert exit_info.value.code == cli.EXIT_USER_ERROR
    assert fragment in capsys.readouterr().err


def test_compress_draws_what_was_kept(capsys, tiny, context_file, tmp_path):
    png, page = tmp_path / "pics" / "kept.png", tmp_path / "kept.html"
    argv = [
        "compress",
        "--model",
        "tiny",
        "--context",
        str(context_file),
        "--ratio",
        "0.3",
        "--question",
        QUESTION,
        "--max-new-tokens",
        "2",
        "--plot",
        str(png),
        "--html",
        str(page),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"wrote {png}" in out and f"wrote {page}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = page.read_text()
    context, _ = prompts.split_for_reuse(tiny.tokenizer, CONTEXT, [])
    assert text.count('<span class="t"') == len(context) - context.context_start  # one span per context token
    spans = re.findall(r'<span class="t"[^>]*>(.*?)</span>', text, flags=re.S)
    assert html.unescape("".join(spans)).replace("<br>\n", "\n") == CONTEXT  # the context, token by token
    kept_line = next(line for line in out.splitlines() if line.startswith("tokens kept: "))
    kept, total = (int(x) for x in kept_line.split()[2:5:2])
    shown = float(text.split("% of the context's pairs kept")[0].rsplit("; ", 1)[1])
    assert abs(shown - 100 * kept / total) < 0.05  # the page's share is the cache's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["context.txt", "kept.html", "pics"]  # no temporary left


def test_compress_with_kv_bits_quantizes_what_it_keeps_and_ask_reads_it_as_saved(
    capsys, monkeypatch, tiny, context_file, tmp_path
):
    """--kv-bits 8 / 4 / 8/4 quantize the compressed cache: the same kept pairs, fewer bytes (int4 fewer than int8,
    int8 keys beside int4 values between them), an answer either way; centred keys (the default; --no-kv-center) add
    their centres' bytes; a group that does not split the head dim is a usage error. ask --kv-bits quantizes a saved
    unquantized cache on load; a cache saved with --kv-bits 4 or 8/4 is asked as saved (its format in the
    manifest), and asking it at another width is a usage error."""
    from kvzip_jax import cache_io

    used = {}
    uncentred = ["--no-kv-center"]
    # Each form answering compiles its own question prefill and decode loop (~13 s each, a loaded cache's again): the
    # uncentred int8 and int4 caches are only sized here (int8, int4 and 8/4 answer below through ask, the 8/4 one as
    # saved here; uncentred caches decode in test_quantized_cache.py's uncentred forms and test_eval_sweep.py's
    # kv_center=False sweep); compress itself answers from the plain and the centred int4 cache.
    for name, bits, flags, asked in (
        ("16", "16", [], True),
        ("8", "8", uncentred, False),
        ("4", "4", uncentred, False),
        ("8/4", "8/4", uncentred, False),
        ("4-centred", "4", [], True),
    ):
        saved = {"16": "doc.kv", "8/4": "doc84.kv", "4-centred": "doc4.kv"}.get(name)
        monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no --question: none from stdin either
        argv = [
            "compress",
            "--model",
            "tiny",
            "--context",
            str(context_file),
            "--ratio",
            "0.3",
            *(["--question", QUESTION, "--max-new-tokens", "4"] if asked else []),
            "--chunk-size",
            "64",
            "--kv-bits",
            bits,
            "--kv-group",
            "4",
            *flags,
            *(["--save", str(tmp_path / saved)] if saved else []),
        ]
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        line = next(line for line in out.splitlines() if line.startswith("KV cache bytes: compressed"))
        layout = {"16": "ragged, room", "8/4": "int8 keys in groups of 4, int4 values in groups of 4"}
        assert layout.get(bits, f"int{bits} in groups of 4") in line
        used[name] = int(line.split()[4].replace(",", ""))
        assert out.count("\nA: ") == (1 if asked else 0)
    # head dim 8, float32: 64 bytes per pair; int8 with groups of 4: 2 x (8 + 2 x 2 x 2) = 32; int4: 24; 8/4: 28
    assert used["16"] / 64 == used["8"] / 32 == used["4"] / 24 == used["8/4"] / 28
    assert used["4-centred"] - used["4"] == 2 * 2 * 8 * 2  # layers x KV heads x head dim, bf16
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            ["compress", "--model", "tiny", "--context", str(context_file), "--ratio", "0.3", "--question", QUESTION]
            + ["--kv-bits", "4", "--kv-group", "3"]
        )
    assert exit_info.value.code == cli.EXIT_USER_ERROR and "--kv-group: group must be" in capsys.readouterr().err

    def ask(name, *flags):
        return cli.main(
            ["ask", "--cache", str(tmp_path / name), "--question", QUESTION, "--max-new-tokens", "4", *flags]
        )

    for name, flags, label in (("doc.kv", ("--kv-bits", "8", "--kv-group", "4"), "int8"), ("doc4.kv", (), "int4")):
        assert ask(name, *flags) == 0
        out = capsys.readouterr().out
        assert f", {label}, " in out and out.count("\nA: ") == 1
    layout = cache_io.read_manifest(tmp_path / "doc4.kv")["layers"][0]
    assert layout["bits"] == 4 and "key_center" in layout["fields"]
    manifest = cache_io.read_manifest(tmp_path / "doc84.kv")  # values in other bits than keys: layout 4
    assert (manifest["layers"][0]["bits"], manifest["layers"][0]["v_bits"], manifest["layout_version"]) == (8, 4, 4)
    assert ask("doc84.kv") == 0
    out = capsys.readouterr().out
    assert ", k8v4, " in out and out.count("\nA: ") == 1
    for name, bits, message in (
        ("doc4.kv", "8", "saved with --kv-bits 4"),
        ("doc84.kv", "4", "saved with --kv-bits 8/4"),
        ("doc.kv", "4/8", "8/4 (int8 keys, int4 values)"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            ask(name, "--kv-bits", bits)
        assert exit_info.value.code == cli.EXIT_USER_ERROR and message in capsys.readouterr().err
