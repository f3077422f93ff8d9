"""Markdown tables from benchmark JSON: python benchmarks/table.py results.json [...]"""

import json
import sys


def main() -> None:
    for path in sys.argv[1:]:
        with open(path) as f:
            d = json.load(f)
        env = d["env"]
        print(f"<!-- {path}: {env} copy {d['copy_GB/s']} GB/s -->")
        if d["bench"] == "permute":
            print("| config (T, H, E, K) | op | graph ms | % copy BW | eager us |")
            print("|---|---|---|---|---|")
            for r in d["results"]:
                cfg = f"{r['config']} ({r['T']}, {r['H']}, {r['E']}, {r['K']})"
                print(f"| {cfg} | {r['op']} | {r['graph_ms']} | {r['pct_copy_bw']} | "
                      f"{r['eager_ms'] * 1e3:.0f} |")
        elif d["bench"] == "quantize":
            print("| config | T x H | recipe | graph ms | GB/s | % copy | eager ms | torch ms |")
            print("|---|---|---|---|---|---|---|---|")
            for r in d["results"]:
                print(f"| {r['config']} | {r['T']}x{r['H']} | {r['recipe']} | {r['graph_ms']} | "
                      f"{r['GB/s']} | {r['pct_copy_bw']} | {r['eager_ms']} | "
                      f"{r['torch_eager_ms']} |")


if __name__ == "__main__":
    main()
