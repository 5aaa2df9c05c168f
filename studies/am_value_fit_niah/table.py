"""The table of README.md: each method's prediction and KL per niah_single_1 context, from results/."""

import collections
import json

from kvzip_jax.eval import results

rows = collections.defaultdict(dict)
for l in results.read_bytes("studies/am_value_fit_niah/results/results.jsonl").decode().splitlines():
    if not l.strip():
        continue
    r = json.loads(l)
    rows[r["method"]][r["example"]] = r
order = ["full", "am-hak-kb", "am-hak-kb:value_ridge=1000.0", "am-hak-kb:aggregate=max", "kvzip-am"]
p = lambda r: r["prediction"].strip().replace(chr(10), " ")[:14]
ex = sorted(rows["full"])
print("| method | " + " | ".join(e.rsplit("-", 1)[1] for e in ex) + " | right |")
print("|---|" + "---|" * len(ex) + "---:|")
for m in order:
    cells = []
    for e in ex:
        r = rows[m].get(e)
        cells.append("-" if r is None else f"`{p(r)}` ({r['kl']:.3f})" if m != "full" else f"`{p(r)}`")
    n = sum(float(r["score"]) for r in rows[m].values())
    print(f"| `{m}` | " + " | ".join(cells) + f" | {n:g}/{len(rows[m])} |")
