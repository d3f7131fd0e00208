"""Each extra of pyproject.toml declares what its code imports at run time.

A fresh virtual environment holds only what ``pip install ".[extra]"`` pulls in: the package's dependencies, the
extra's, and theirs, transitively (with the extras they name). Each test here builds such a site-packages directory
from this machine's installed distributions (symbolic links to the files of the declared ones only), runs the extra's
code in a fresh interpreter that sees nothing else (``python -S``), and fails when the code needs a module of a
distribution the extra does not declare (datatrove's ``JsonlReader`` imports ``orjson``, which datatrove declares only
in its own ``io`` extra).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_ENV = {"LIT_BALANCE_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK",
              "WORLD_SIZE", "LOCAL_WORLD_SIZE"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extras: tuple[str, ...], project: dict | None = None) -> set[str]:
    """Normalized names of the distributions ``pip install ".[extras]"`` installs: the project's dependencies and
    those of ``extras`` (as pyproject.toml says), then every requirement of those (installed metadata), transitively,
    markers evaluated for this interpreter with the extras each requirement names."""
    project = project or _project()
    wanted = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        wanted += [Requirement(r) for r in project["optional-dependencies"][extra]]
    environment = default_environment()
    seen: dict[str, set[str]] = {}  # distribution -> extras already expanded
    queue = [(req, "") for req in wanted]
    while queue:
        req, extra = queue.pop()
        if req.marker is not None and not req.marker.evaluate({**environment, "extra": extra}):
            continue
        name = _name(req.name)
        if name == _name(project["name"]):  # ".[test]" naming the project's own other extras
            for inner in req.extras:
                queue += [(Requirement(r), "") for r in project["optional-dependencies"][inner]]
            continue
        new = ({""} | set(req.extras)) - seen.get(name, set())
        if not new:
            continue
        seen.setdefault(name, set()).update(new)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # not installed here: the import in the fresh interpreter then fails and names it
        for text in requires:
            for active in new:
                queue.append((Requirement(text), active))
    return set(seen)


def _site_packages(dists: set[str], target: Path) -> None:
    """A site-packages directory at ``target`` holding links to the installed files of ``dists`` only (each
    distribution's top-level modules and packages and its ``.dist-info``, so ``importlib.metadata`` finds it too)."""
    target.mkdir()
    for name in sorted(dists):
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (target / top).exists() and not top.endswith(".pth") and top != "__pycache__":
                (target / top).symlink_to(source)


def run_with_only(extras: tuple[str, ...], code: str, tmp_path: Path, timeout: float = 300
                  ) -> subprocess.CompletedProcess:
    """Run ``code`` in ``python -S`` that sees the standard library, this repository and the distributions
    ``declared(extras)`` only."""
    site = tmp_path / f"site-packages-{'-'.join(extras)}"
    _site_packages(declared(extras), site)
    # a user's shell: nothing of Python's, and none of what a launcher or an earlier in-process run of this worker left
    # (the rank variables, the run id that says which process reports an error first)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k not in LAUNCH_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    return subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_declared_follows_extras_of_requirements():
    # a requirement with an extra pulls that extra's requirements; without it, they stay out
    project = {"name": "p", "dependencies": [], "optional-dependencies": {"a": ["datatrove"], "b": ["datatrove[io]"]}}
    assert "orjson" not in declared(("a",), project)
    assert {"orjson", "pyarrow", "datatrove"} <= declared(("b",), project)


@pytest.mark.slow
def test_datatrove_extra_runs_lit_balance_tokenize_on_jsonl_and_parquet(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "jsonl").mkdir()
    (tmp_path / "parquet").mkdir()
    texts = ["the first document", "a second, longer document of text", "third"]
    (tmp_path / "jsonl" / "c.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    pq.write_table(pyarrow.table({"text": texts}), tmp_path / "parquet" / "c.parquet")
    code = """
        from lit_balance.cli import main
        for reader in ("jsonl", "parquet"):
            main(["tokenize", reader, "--output-folder", f"out_{reader}", "--reader", reader, "--tasks", "1",
                  "--workers", "1"])
    """
    proc = run_with_only(("datatrove",), code, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stdout.count("wrote 3 documents") == 2, proc.stdout


@pytest.fixture(scope="module")
def stores_only(tmp_path_factory) -> subprocess.CompletedProcess:
    """One interpreter with the stores extra only (datatrove not installed): it reads an Arrow store, prints what it
    read, then runs ``lit-balance tokenize``, which must stop it with one line saying what to install."""
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    tmp_path = tmp_path_factory.mktemp("stores_only")
    pq.write_table(pyarrow.table({"input_ids": [[1, 2, 3], [4, 5]]}), tmp_path / "ids.parquet")
    (tmp_path / "c.jsonl").write_text('{"text": "a document"}\n')
    code = """
        from lit_balance.data.stores import ArrowSource
        store = ArrowSource("ids.parquet").open_store()
        print("lengths", store.lengths.tolist(), store.read(0, 3)[0].tolist(), flush=True)
        import sys
        print("tokenize:", file=sys.stderr, flush=True)  # what the store's reading logged stays above this line
        from lit_balance.cli import main
        main(["tokenize", "c.jsonl", "--output-folder", "out"])
    """
    return run_with_only(("stores",), code, tmp_path)


@pytest.mark.slow
def test_stores_and_datasets_extras_read_their_sources(stores_only, tmp_path):
    assert "lengths [3, 2] [1, 2, 3]" in stores_only.stdout, (stores_only.stdout + stores_only.stderr)[-3000:]
    datasets = """
        import datasets
        from lit_balance.data.sources.hf import HuggingFaceSource
        source = HuggingFaceSource(datasets.Dataset.from_dict({"text": ["a b", "c"]}))
        print("texts", source.load_texts())
    """
    proc = run_with_only(("datasets",), datasets, tmp_path)
    assert proc.returncode == 0 and "texts ['a b', 'c']" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]


def test_the_test_extra_installs_what_the_stores_datasets_and_datatrove_extras_do():
    # the tests run the code of those extras: the README's test command must install their needs
    test = declared(("test",))
    for extra in ("stores", "datasets", "datatrove"):
        assert declared((extra,)) <= test, (extra, sorted(declared((extra,)) - test))


@pytest.mark.slow
def test_tokenize_without_datatrove_says_what_to_install_in_one_line(stores_only):
    lines = stores_only.stderr.split("tokenize:\n", 1)[-1].splitlines()  # what tokenize printed
    assert stores_only.returncode == 2 and len(lines) == 1, stores_only.stderr[-3000:]
    assert lines[0] == ('lit-balance tokenize: error: lit-balance tokenize runs datatrove, which is not installed: '
                        'pip install -e ".[datatrove]" (in a clone of lit_balance)'), lines
