import sys, collections, re
f = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
threads = collections.Counter(); leaf = collections.Counter(); incl = collections.Counter(); total = 0
for line in open(f):
    stack, cnt = line.rstrip().rsplit(" ", 1); cnt = int(cnt)
    frames = stack.split(";")
    th = frames[0]; threads[th] += cnt; total += cnt
    fr = [re.sub(r" \(.*?\)", "", x) for x in frames[1:]]
    # leaf: last frame; collapse to function name
    leaf[fr[-1] if fr else "?"] += cnt
    for x in set(fr): incl[x] += cnt
print("total", total)
for k, v in threads.most_common(): print(f"{v:7d} {k}")
print("--- self")
for k, v in leaf.most_common(n): print(f"{v:7d} {100*v/total:5.1f}% {k}")
print("--- inclusive")
for k, v in incl.most_common(n): print(f"{v:7d} {100*v/total:5.1f}% {k}")
