#!/usr/bin/env python3
"""The commands of README.md's quick start, so that CI runs them as written.

    python3 .ci/readme_commands.py N     # prints the N-th command (1-based)
    python3 .ci/readme_commands.py       # prints how many there are

The commands are the lines of the first ```bash block under "## Quick start" that are neither
blank nor comments. .ci/run runs each from this output and tests/test_readme.py checks what
each one installs against what it imports, both through :func:`quick_start_commands`, so the
README, CI and the test cannot drift apart. Standard library only: it runs before any install.
"""
import os
import sys
from typing import List

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
HEADING = "## Quick start"


def quick_start_commands(text: str) -> List[str]:
    """The quick-start block's commands in ``text`` (a README), in order.

    Raises:
        ValueError: no "## Quick start" heading, no ```bash block under it before the next
            heading, or a block without a command.
    """
    lines = text.splitlines()
    try:
        i = next(k for k, line in enumerate(lines) if line.strip() == HEADING)
    except StopIteration:
        raise ValueError(f"README has no {HEADING!r} heading") from None
    for j in range(i + 1, len(lines)):
        if lines[j].startswith("#"):
            break   # the next heading: no block in this section
        if lines[j].strip() == "```bash":
            block = []
            for body in lines[j + 1:]:
                if body.strip() == "```":
                    commands = [c.strip() for c in block
                                if c.strip() and not c.strip().startswith("#")]
                    if not commands:
                        raise ValueError(f"the {HEADING!r} block has no command")
                    return commands
                block.append(body)
            raise ValueError(f"the {HEADING!r} block is not closed")
    raise ValueError(f"no ```bash block under {HEADING!r}")


def main(argv: List[str]) -> int:
    with open(README, encoding="utf-8") as f:
        commands = quick_start_commands(f.read())
    if not argv:
        print(len(commands))
        return 0
    n = int(argv[0])
    if not 1 <= n <= len(commands):
        print(f"readme_commands: no command {n}: the quick start has {len(commands)}",
              file=sys.stderr)
        return 2
    print(commands[n - 1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
