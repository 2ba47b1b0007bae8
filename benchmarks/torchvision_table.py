"""Print the torchvision coverage table of docs/torchvision-coverage.md: every classification
builder, converted or not.

    .venv/bin/python benchmarks/torchvision_table.py > /tmp/table.md
    .venv/bin/python benchmarks/torchvision_table.py vit_l_32 wide_resnet50_2   # only these rows
"""
import sys
import warnings

import torchvision

from pipeline.neural_graph.coverage import BUDGET_RULE, check_builder

warnings.filterwarnings("ignore")
names = sys.argv[1:] or sorted(torchvision.models.list_models(module=torchvision.models))
rows = []
print("| builder | result | params | nodes | edges | note |\n|---|---|---:|---:|---:|---|")
for name in names:
    row = check_builder(name)
    note = row.reason.split("unsupported module at ")[-1] if row.status == "unsupported" else (
        "" if row.materialised else "counted from the plan (not inverted: one operation exceeds the check's memory budget)")
    if row.unread:
        note = (note + "; " if note else "") + f"{len(row.unread)} state entries the evaluated network never reads " \
            f"(e.g. {row.unread[0]}) are not in the graph"
    print(f"| {name} | {row.status} | {row.params:,} | {row.nodes or ''} | {row.edges or ''} | {note} |", flush=True)
    rows.append(row)
ok = sum(r.status == "converts" for r in rows)
checked = sum(r.materialised for r in rows)
print(f"\n{ok} of {len(rows)} builders convert; the others stop with UnsupportedModuleError.\n"
      f"Exact inverse checked on {checked} of {ok}: {BUDGET_RULE}.", file=sys.stderr)
