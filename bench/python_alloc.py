"""An allocation-heavy Python workload for scripts/bench.sh (run with PYTHONMALLOC=malloc,
so that every object is a malloc the tools see): builds, serialises and drops records."""
import json

total = 0
for round_ in range(40):
    records = [{"id": i, "name": f"item-{i}", "tags": [str(i % 7), str(i % 11)], "score": i * 0.5} for i in range(5000)]
    text = json.dumps(records)
    back = json.loads(text)
    total += len(back) + len(text)
    index = {r["name"]: r for r in back}
    total += len(index)
print(total)
