"""Every config key zeal documents acts, or says that it does not.

For each field of the schema (engine/config/schema.cpp) the Config member it sets is found, and the
code outside engine/config/ (the engine, offload, kernels, the CLI, the examples) is searched for a
read of that member. A key whose member only the config layer touches (parsing, validation,
printing) must say so in its row of docs/configuration.md ("nothing reads it", "without effect" or
"no effect"); a key that is read must not claim to be unread. Run from the source root; exit 1 names
each key that breaks the rule.
"""
import pathlib, re, sys

root = pathlib.Path(".")
schema = (root / "engine/config/schema.cpp").read_text()
docs = (root / "docs/configuration.md").read_text()

# Each f.push_back( … ) up to the next one: its first string literal is the key, its first
# ZEAL_GET(member) (or, for a hand-written field, its first c.member) the Config member it sets.
fields = {}
for chunk in schema.split("f.push_back(")[1:]:
    key = re.search(r'"([a-z_0-9.]+)"', chunk)
    member = re.search(r"ZEAL_GET\(([a-z_0-9.]+)\)", chunk) or re.search(r"\bc\.([a-z_0-9.]+)\s*=", chunk)
    if key and member:
        fields[key.group(1)] = member.group(1)
if len(fields) < 60:
    sys.exit(f"keys_act: found only {len(fields)} schema fields: has engine/config/schema.cpp changed shape?")

sources = []
for d in ("engine", "offload", "kernels", "cli", "examples", "benchmarks"):
    for p in (root / d).rglob("*"):
        if p.suffix in (".cpp", ".h", ".cu") and "engine/config" not in p.as_posix():
            sources.append(p.read_text(errors="replace"))
code = "\n".join(sources)

# What a row says of a key only the config layer reads: that it has no effect, or what it acts
# through there (a refusal, a key it sets, values it derives).
unread_words = ("nothing reads it", "without effect", "no effect", "No effect", "refused", "sets `", "derives")
problems = []
for key, member in sorted(fields.items()):
    # A read: the member's last name after a dot or an arrow, not called (config_.zero.x, s.x,
    # o->x; a sub-structure is often handed on whole, so its fields are read under other names).
    name = member.split(".")[-1]
    read = re.search(r"(?:\.|->)" + re.escape(name) + r"\b(?!\s*\()", code) is not None
    row = next((l for l in docs.splitlines() if l.startswith(f"| `{key}` |")), None)
    if row is None:
        problems.append(f"{key}: no row in docs/configuration.md")
        continue
    says_unread = any(w in row for w in unread_words)
    if not read and not says_unread:
        problems.append(f"{key}: only the config layer reads {member}, but its row does not say it has no effect")
    if read and any(w in row for w in ("nothing reads it", "No effect", "no effect")):
        problems.append(f"{key}: {member} is read outside the config layer, but its row says it has no effect")
for p in problems:
    print("FAIL:", p)
print(f"keys_act: {len(fields)} keys, {len(problems)} problems")
sys.exit(1 if problems else 0)
