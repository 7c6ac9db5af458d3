"""README.md's table in "Re-running GPU chapters" is the one table of regeneration commands: every `lowprec`
command a chapter's Regenerate text gives is one of its rows. Pure text, no commands run.

The rules, the same for a chapter and for the README:
- A chapter's Regenerate text starts at a paragraph that begins with "**Regenerate" or at a heading that
  contains "Regenerate", and ends at the next heading or code cell. A chapter that reads committed records
  (`../results/`) must have one that gives at least one command.
- A command is a backticked span, or a logical line of a fenced block (`\\` continuations joined, `# ...`
  comments dropped), from its word `lowprec` on (`timeout -s TERM 175 lowprec train ...` gives `lowprec
  train ...`); whitespace is normalised. It must name a command of `lowprec.cli.COMMANDS`.
- In the README a command is a pattern: `...` stands for any further words (a chapter's `$LEAD` too), an
  upper-case word (RUN, STEP, EPS, also inside a word: `ckpt-STEP.pt`) for any one value, the same value
  each time the word recurs. A chapter's command must match one of the table's commands whole (a placeholder
  the chapter writes itself, as in `RUN --ckpt RUN/...`, matches too).
- A command that is only words (`lowprec bench attention`, `lowprec data pack`) names a command rather than
  giving one: a table command that starts with those words covers it.
- A backticked option span (`--cures --optimizers adam`, "the same with ...") gives a variant: it must
  appear in a span of the table, unless it only points into one of the same Regenerate text's commands.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lowprec.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "book").glob("*.md"))
START = re.compile(r"\*\*Regenerate|#+ .*Regenerate")
HEADING = re.compile(r"#+ ")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")
PLACEHOLDER = re.compile(r"(?<![A-Za-z0-9])[A-Z][A-Z0-9_]*(?![A-Za-z0-9])")
WORD = re.compile(r"[a-z][a-z0-9-]*")


def regenerate_text(chapter: str) -> str:
    """The chapter's Regenerate text ("" if it has none); a `#` line inside a fenced block is no heading."""
    lines, fenced, inside = [], False, False
    for line in chapter.splitlines():
        if inside and not fenced and (line.startswith("```{code-cell}") or HEADING.match(line)):
            break
        inside = inside or (not fenced and START.match(line) is not None)
        fenced ^= line.startswith("```")
        if inside:
            lines.append(line)
    return "\n".join(lines)


def readme_table(readme: str) -> str:
    """The table rows of README's "Re-running GPU chapters" section."""
    section = readme.split("## Re-running GPU chapters", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def code_lines(text: str) -> list[str]:
    """The logical lines of the fenced blocks (not `{directive}`s) in text, without comments."""
    lines = []
    for info, block in FENCE.findall(text):
        if not info.startswith("{"):
            lines += [re.sub(r"(^|\s)#.*", "", line) for line in block.replace("\\\n", " ").splitlines()]
    return [" ".join(line.split()) for line in lines if line.strip()]


def inline_spans(text: str) -> list[str]:
    """The backticked spans outside fenced blocks (inside `{directive}`s too), whitespace normalised."""
    markdown = FENCE.sub(lambda m: m[2] if m[1].startswith("{") else "", text)
    return [" ".join(s.split()) for s in INLINE.findall(markdown) if s.strip()]


def commands(text: str) -> list[str]:
    """The `lowprec ...` commands in text, each from its word `lowprec` on."""
    out = []
    for span in code_lines(text) + inline_spans(text):
        words = span.split()
        if "lowprec" in words[:-1]:
            out.append(" ".join(words[words.index("lowprec") :]))
    return out


def variants(text: str) -> list[str]:
    """The backticked option spans (`--flag value ...`) in text."""
    return [s for s in inline_spans(text) if s.startswith("--")]


def command_name(command: str) -> str | None:
    """`lowprec bench attention` for `lowprec bench attention --out x`; None if COMMANDS lacks the command."""
    words = command.split()
    entry = COMMANDS.get(words[1])
    if isinstance(entry, dict):
        return " ".join(words[:3]) if len(words) > 2 and words[2] in entry else None
    return " ".join(words[:2]) if entry else None


def pattern(template: str) -> re.Pattern[str]:
    """A README command as a pattern: `...` for any further words, an upper-case word for one value."""
    regex, seen = "", set()
    for i, word in enumerate(template.split()):
        if word == "...":
            regex += r"(?: \S+)*"
            continue
        regex += " " if i else ""
        last = 0
        for m in PLACEHOLDER.finditer(word):
            regex += re.escape(word[last : m.start()])
            regex += f"(?P={m[0]})" if m[0] in seen else rf"(?P<{m[0]}>\S+?)"
            seen.add(m[0])
            last = m.end()
        regex += re.escape(word[last:])
    return re.compile(regex)


def covered(command: str, table_commands: list[str]) -> bool:
    """The command matches one of the table's commands, or, if it only names a command, starts one."""
    words = command.split()
    if all(WORD.fullmatch(w) for w in words):
        return any(t.split()[: len(words)] == words for t in table_commands)
    return any(pattern(t).fullmatch(command) for t in table_commands)


def missing(chapter: str, readme: str) -> list[str]:
    """The chapter's Regenerate commands and variants that README's table lacks."""
    text, table = regenerate_text(chapter), readme_table(readme)
    own, table_commands, table_spans = commands(text), commands(table), inline_spans(table)
    lacking = [c for c in own if not covered(c, table_commands)]
    return lacking + [
        v for v in variants(text)
        if not any(f" {v} " in f" {s} " for s in table_spans + own)
    ]  # fmt: skip


README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_regenerate_commands_are_in_the_readme_table(path: Path) -> None:
    chapter = path.read_text()
    if "../results/" in chapter:
        assert commands(regenerate_text(chapter)), f"{path.name} reads records, gives no Regenerate command"
    assert not missing(chapter, README), f"{path.name}: README's table lacks {missing(chapter, README)}"


def test_every_command_names_a_lowprec_command() -> None:
    texts = [readme_table(README)] + [regenerate_text(p.read_text()) for p in CHAPTERS]
    unknown = [c for text in texts for c in commands(text) if command_name(c) is None]
    assert not unknown, unknown


TABLE = """intro

## Re-running GPU chapters

| record | command | time |
|---|---|---|
| `x.json` | `lowprec bench attention --out x.json --seq 1024` | 1 min |
| `runs` | `lowprec experiment bias-noise RUN --ckpt RUN/ckpt-STEP.pt ... --out ...` | 1 min |
| `pc` | `lowprec experiment positive-control --series` and with `--cures --optimizers adam` | 1 min |
| `data` | `lowprec data pack DIR --out shards/` | 1 min |

`lowprec train --not-in-the-table`

## Next
"""


def chapter_with(regenerate: str) -> str:
    """A fake chapter whose Regenerate paragraph is `regenerate`, with commands before and after it."""
    before, after = "# 9. Fake\n\n`lowprec train --before`.\n\n", "\n\n## After\n\n`lowprec train --after`\n"
    return f"{before}**Regenerate.** {regenerate}{after}"


def test_a_command_the_readme_lacks_is_caught() -> None:
    good = "From `lowprec bench attention --out x.json\n--seq 1024` (its name: `lowprec bench attention`)."
    assert missing(chapter_with(good), TABLE) == []
    assert missing(chapter_with(good + " And `lowprec bench attention --out y.json`."), TABLE) == [
        "lowprec bench attention --out y.json"
    ]
    # outside the table and outside the Regenerate text nothing counts
    outside = "lowprec train --not-in-the-table"
    assert missing(chapter_with(f"`{outside}`"), TABLE) == [outside]
    assert commands(regenerate_text(chapter_with("none"))) == [] and regenerate_text("# no section") == ""


def test_placeholders_and_variants() -> None:
    ok = "lowprec experiment bias-noise r/a --ckpt r/a/ckpt-0002.pt --spec fa2 --out o.json"
    assert missing(chapter_with(f"`{ok}`"), TABLE) == []
    as_written = "lowprec experiment bias-noise RUN --ckpt RUN/ckpt-STEP.pt --out ..."  # placeholders match
    assert missing(chapter_with(f"`{as_written}`"), TABLE) == []
    other_run = "lowprec experiment bias-noise r/a --ckpt r/b/ckpt-0002.pt --out o.json"  # RUN differs
    assert missing(chapter_with(f"`{other_run}`"), TABLE) == [other_run]
    names = "`lowprec data pack` / `lowprec data unpack`"  # only names: a table command starting so covers it
    assert missing(chapter_with(names), TABLE) == ["lowprec data unpack"]
    variant = "`lowprec experiment positive-control --series`, the same with `--cures --optimizers adam`"
    assert missing(chapter_with(variant), TABLE) == []
    other = "--cures --optimizers sgd"
    assert missing(chapter_with(f"{variant} or `{other}`"), TABLE) == [other]


def test_fenced_blocks() -> None:
    block = """Probe:

```text
timeout -s TERM 175 lowprec bench attention --out x.json \\
  --seq 1024   # the first
LEAD="--seeds 1"
lowprec experiment bias-noise r --ckpt r/ckpt-1.pt $LEAD --out o
# a comment line, no heading
lowprec bench train --config tiny
```

and the same `--seq 1024`."""
    assert commands(regenerate_text(chapter_with(block))) == [
        "lowprec bench attention --out x.json --seq 1024",
        "lowprec experiment bias-noise r --ckpt r/ckpt-1.pt $LEAD --out o",
        "lowprec bench train --config tiny",
    ]
    assert missing(chapter_with(block), TABLE) == ["lowprec bench train --config tiny"]
    assert command_name("lowprec bench train --config tiny") == "lowprec bench train"
    assert command_name("lowprec bench atention") is None and command_name("lowprec trian") is None
