"""bench/ruler_same_ids.py: our layout of a kvpress-format file's samples against ids kvpress's preprocessing gave
(here the test's own line-for-line copy of it, tests/test_prompts.py; the pipeline's own dump is the committed
bench/results/ruler-4096-qwen2.5-coder-0.5b/same-ids.txt)."""

import json

from kvzip_jax.eval.tasks import dataset, ruler
from kvzip_jax.weights import registry

from .conftest import bench_module, bundled_tokenizer, tokenizer_folder
from .test_prompts import kvpress_preprocess


def _bench():
    return bench_module("ruler_same_ids")


def test_equal_ids_pass_and_a_changed_id_is_named(tmp_path, capsys):
    bench = _bench()
    tokenizer = bundled_tokenizer(registry.SMOLLM2)
    examples = ruler.generate("ruler_vt", 1, 1024, tokenizer) + ruler.generate("ruler_fwe", 1, 1024, tokenizer)
    data = dataset.write(examples, tmp_path / "samples.jsonl")
    dumps = []
    for ex in examples:
        context_ids, question_ids = kvpress_preprocess(tokenizer, ex.context, list(ex.questions), ex.answer_prefix)
        dumps.append(dict(task=ex.task, example=ex.id, context_ids=context_ids, question_ids=question_ids))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(dumps))
    argv = ["--dataset", str(data), "--ids", str(ids), "--tokenizer", str(tokenizer_folder(registry.SMOLLM2))]
    assert bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1].split(" (")[0] for line in lines] == [" equal", " equal"]
    dumps[1]["context_ids"][7] += 1
    ids.write_text(json.dumps(dumps))
    assert bench.main(argv) == 1
    assert "ruler_fwe" in (out := capsys.readouterr().out) and "context differs at id 7" in out
    assert bench.first_difference([1, 2], [1, 2, 3]) == 2 and bench.first_difference([1], [1]) is None
