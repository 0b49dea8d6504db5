import re, sys, collections
cur = None; tree = None; d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    if line.startswith('### tree'):
        tree = line.split()[2]
    elif line.strip().startswith('null'):
        for k, v in re.findall(r'([abc])\s+([\d.]+)', line): d[(cur, k, tree)].append(float(v))
    elif line.strip():
        cur = line.strip()
for (case, k, tree), v in sorted(d.items()):
    print(f"{case:32s} {k} {tree:6s} {' '.join(f'{x:5.1f}' for x in v)}")
