"""Prints the EP_PLUGIN_COMBINE_OVERLAP mode whose 16-SM combine median (mean over its runs) is lowest."""
import glob, json, os, statistics, sys
medians = {}
for path in glob.glob(os.path.join(sys.argv[1], "variant_o*_16*.json")):
    mode = os.path.basename(path)[len("variant_o"):][0]
    medians.setdefault(mode, []).append(json.load(open(path))["runs"][0]["ops"]["combine"]["median_us"])
for mode, values in sorted(medians.items()):
    print(f"mode {mode}: 16-SM combine medians {values}", file=sys.stderr)
print(min(medians, key=lambda m: statistics.mean(medians[m])))
