"""The shell blocks of the user's guide (README.md, then the docs/ pages in `GUIDE` order),
run as a new user types them.

Every ```sh block runs as one bash script, verbatim, in its page's order, from the root of a
checkout of the page's own (a scratch copy whose files link to this one's, so that `runs/` and
`.cache/` land in the scratch folder), in a shell without the virtual environment: no .venv/bin
on PATH, no VIRTUAL_ENV. $RANKMIX_OVERRIDES (see the README) shortens every training to a few
steps. One test a page, so that pytest-xdist's workers share the guide; pages that read what
another page made run after it in the same test (`TOGETHER`). The checkout's `.venv/bin/rankmix`
is tests/cli.py's shim: each command runs as a `rankmix` process forked from the suite's preloaded
server, as the CLI tests' commands do, instead of a fresh interpreter importing the stack (about
half of the blocks' time); every other program of the environment is the real one.

A block after a `<!-- readme-test: not run here: REASON -->` line (clusters, GPUs, real
object stores, placeholders such as DIR) is not run; each of its commands is still parsed,
and every option it names must be one that the command's own --help lists.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cli import shim_server
from test_launch import bare_env

REPO = Path(__file__).resolve().parents[1]
# The guide's pages in reading order: a block may use what an earlier block of its page made.
GUIDE = [REPO / "README.md", *(REPO / "docs" / f"{page}.md" for page in (
    "training", "distributed", "checkpoints", "serving", "data", "continuous", "models", "results", "performance",
    "scale"))]
# Pages run in one checkout, in this order: Checkpoints and Serving score and export the
# MovieLens run that Training trains (runs/movielens).
TOGETHER = ((REPO / "docs" / "training.md", REPO / "docs" / "checkpoints.md", REPO / "docs" / "serving.md"),)
MARKER = re.compile(r"<!-- readme-test: not run here: (.+?) -->")
# What the runnable blocks' trainings are cut to; the README names this variable.
OVERRIDES = ("--train.steps=3 --data.synth_rows=4000 --metrics.progress=false --metrics.tensorboard=false "
             "--metrics.eval_batches=2")
# A command a block may hold that the test leaves out, and why.
LEFT_OUT = {"make test": "the test suite itself"}


def blocks(pages: tuple[Path, ...] = tuple(GUIDE)) -> list[tuple[str, str, str | None]]:
    """(page:line, text, why not run or None) of every ```sh block of `pages`."""
    out = []
    for page in pages:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```sh":
                end = lines.index("```", i + 1)
                marker = MARKER.search(lines[i - 1]) if i else None
                out.append((f"{page.relative_to(REPO)}:{i + 1}", "\n".join(lines[i + 1:end]),
                            marker.group(1) if marker else None))
                i = end
            i += 1
    return out


def commands(text: str) -> list[list[str]]:
    """The block's commands as argument lists: continuation lines joined, comments dropped."""
    joined = text.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if shlex.split(line, comments=True)]


@functools.cache
def help_text(*command: str) -> str:
    proc = subprocess.run([*command, "--help"], cwd=REPO, env=bare_env(), capture_output=True, text=True,
                          timeout=120)
    return proc.stdout + proc.stderr


def option_checks(argv: list[str]) -> list[tuple[list[str], str]]:
    """(options, the --help text that must list them) for `argv`: `rankmix launch` and
    `torchrun -m launch.cli train` pass what they do not know on to `rankmix train`."""
    venv = str(Path(sys.executable).parent)
    program = Path(argv[0]).name
    train = help_text(f"{venv}/rankmix", "train")
    if program == "rankmix":
        sub = argv[1:3] if argv[1] == "data" else argv[1:2]
        own = help_text(f"{venv}/rankmix", *sub)
        names = options(argv)
        # --section.key=value overrides (score and export take them too) are `rankmix train`'s
        keys = [name for name in names if "." in name]
        rest = [name for name in names if "." not in name]
        return [(keys, train), (rest, own + train if sub == ["launch"] else own)]
    if program == "torchrun":
        split = argv.index("-m")
        return [(options(argv[:split]), help_text(f"{venv}/torchrun")), (options(argv[split + 1:]), train)]
    if program == "torchx":
        component = next(a for a in argv if a.endswith(".py:train"))
        return [(options(argv), help_text(f"{venv}/torchx", "run")
                 + help_text(f"{venv}/torchx", "run", "-s", "local_cwd", component))]
    return []


def options(argv: list[str]) -> list[str]:
    """The `--name` options of `argv`, without their values (and without what follows `--`)."""
    names = []
    for arg in argv[1:]:
        if arg == "--":
            break
        if arg.startswith("--") and arg != "--help":
            names.append(arg.split("=", 1)[0])
    return names


def listed(option: str, text: str) -> bool:
    """Whether `--help` declares `option`: a line of its option list that starts with it
    (`--key=`, `--key ARG`, `--key, --alias`, `-k, --key`) or `[--key` in the usage; a mention in
    prose does not count."""
    name = re.escape(option)
    if re.search(rf"^ *(-\w+ \w+, |-\w+, )?{name}([=, ]|$)|\[{name}[ \]]", text, re.M):
        return True
    # a key of a table of free keys (`--data.catalog.s3.endpoint`): the table is listed with `={}`
    parts = option.split(".")
    return any(re.search(rf"^ *{re.escape('.'.join(parts[:i]))}={{}}", text, re.M) for i in range(2, len(parts)))


def page_runs() -> list[tuple[Path, ...]]:
    """The pages with a runnable block, each alone or with those it runs `TOGETHER` with."""
    runs = []
    for page in GUIDE:
        run = next((group for group in TOGETHER if page in group), (page,))
        if run[0] == page and any(why is None for _, _, why in blocks(run)):
            runs.append(run)
    return runs


@pytest.fixture
def checkout(tmp_path_factory) -> Path:
    """A new scratch checkout: every tracked top-level entry and .venv linked to this one, and
    ../shared beside it, so that relative paths resolve as they do here."""
    # The guide's `make train` runs `make setup` in the scratch checkout, whose .venv is this
    # one: with a stale stamp it would reinstall this package from the scratch folder, and
    # every console script would then start a Python that vanishes with it. Set up here first.
    subprocess.run(["make", "setup"], cwd=REPO, check=True, capture_output=True)
    root = tmp_path_factory.mktemp("readme")
    repo = root / "rankmix"
    repo.mkdir()
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for top in {line.split("/", 1)[0] for line in tracked.splitlines()}:
        (repo / top).symlink_to(REPO / top)
    # the environment running the tests, every entry linked but bin/rankmix (test_runnable_blocks_run_verbatim's shim)
    venv, real = repo / ".venv", Path(sys.executable).parents[1]
    venv.mkdir()
    for entry in real.iterdir():
        if entry.name != "bin":
            (venv / entry.name).symlink_to(entry)
    (venv / "bin").mkdir()
    for entry in (real / "bin").iterdir():
        if entry.name != "rankmix":
            (venv / "bin" / entry.name).symlink_to(entry)
    if (REPO.parent / "shared").exists():
        (root / "shared").symlink_to(REPO.parent / "shared")
    return repo


def test_every_guide_page_is_tested_and_the_readme_stays_short():
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"design.md"}
    assert pages == {p.name for p in GUIDE[1:]}, "a docs/ page is missing from GUIDE"
    assert len(GUIDE[0].read_text().splitlines()) < 300, "README.md is the short guide: details go to docs/"


def test_every_block_is_run_or_says_why_not():
    found = blocks()
    assert len(found) > 10 and any(why is None for _, _, why in found)
    for line, _text, why in found:
        assert why is None or len(why) > 10, f"{line}: say why the block is not run"


def test_options_of_blocks_not_run_exist():
    train = help_text(f"{Path(sys.executable).parent}/rankmix", "train")
    for word in ("--steps", "--lr", "--batch_size"):  # words of its prose, not options
        assert not listed(word, train), word
    for line, text, why in blocks():
        if why is None:
            continue
        for argv in commands(text):
            for names, text_of_help in option_checks(argv):
                for option in names:
                    assert listed(option, text_of_help), \
                        f"{line}: {' '.join(argv[:3])} has no option {option}"


def reads_shared_data(text: str) -> bool:
    """Whether a block reads ../shared/data (the samples beside the checkout), itself or through
    a config file it names."""
    configs = [REPO / name for name in re.findall(r"configs/[\w.-]+\.toml", text)]
    return "../shared/" in text or any(c.is_file() and "../shared/" in c.read_text() for c in configs)


def test_blocks_that_read_the_shared_samples_are_known_as_such():
    found = [text for _, text, why in blocks() if why is None and reads_shared_data(text)]
    assert any("../shared/data/movielens-100k" in text for text in found)  # docs/data.md's conversion
    assert any("configs/movielens.toml" in text and "../shared/" not in text for text in found)  # through its config


@pytest.mark.slow
@pytest.mark.parametrize("pages", page_runs(), ids=lambda pages: "+".join(p.stem for p in pages))
def test_runnable_blocks_run_verbatim(pages, checkout):
    if not (REPO.parent / "shared" / "data").is_dir() and \
            any(why is None and reads_shared_data(text) for _, text, why in blocks(pages)):
        pytest.skip("these pages' blocks read ../shared/data (MovieLens-100K), which is not beside this checkout")
    env = {**bare_env(), "RANKMIX_OVERRIDES": OVERRIDES}
    with shim_server(checkout / ".venv" / "bin"):
        run_blocks(pages, checkout, env)


def run_blocks(pages: tuple[Path, ...], checkout: Path, env: dict[str, str]) -> None:
    for line, text, why in blocks(pages):
        if why is not None:
            continue
        script = "\n".join(row for row in text.splitlines()
                           if not any(row.strip().startswith(cmd) for cmd in LEFT_OUT))
        proc = subprocess.run(["bash", "-e", "-c", script], cwd=checkout, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{line}:\n{script}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
