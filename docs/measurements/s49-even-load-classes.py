# Session 49: the tuned tables' classes gain their loads (`kernels.tile_configs.LOADS`). Every entry a search tuned on
# a `routing: balanced` shape (`bench.experts.shape_of_run` names them `...-balanced`, and the table's `measured`
# records the shape) moves to its class's `/even` key; the others (the Zipf-routed bench shapes, learned-routing
# configs) stay the routed classes. What every run launches does not change: a class tuned for one loads only is read
# by runs of either (`tile_configs.tuned`). Run once from the repository root: python
# docs/measurements/s49-even-load-classes.py (a second run finds nothing to move).
import json

from disagmoe.kernels.tile_configs import TUNED_DIR

for path in sorted(TUNED_DIR.glob("*.json")):
    table = json.loads(path.read_text())
    moved = [key for key, measured in table["measured"].items()
             if "-balanced" in measured.get("shape", "") and not key.endswith("/even")]
    for key in moved:
        for part in ("entries", "measured"):
            table[part][f"{key}/even"] = table[part].pop(key)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{path.name}: {len(moved)} classes tuned on balanced loads moved to /even: {', '.join(moved) or '-'}")
