"""The GPU kit's install, checked where it can fail cheaply (`make gpu-rehearsal`, scripts/gpu_rehearsal.sh).

  gpu_kit.py check WHEELS [--size-limit MIB]   the wheels against the GPU machine (Python 3.12, manylinux x86_64,
                                               gpu_machine_packages.txt): tags, one version each, every requirement
                                               of hf_zero and of each wheel met, the carried size
  gpu_kit.py standins VENV WHEELS [--carried]  a fresh venv's view of the GPU machine: its packages (and with
                                               --carried, gpu_wheels.txt's) linked from this interpreter's copies,
                                               and nothing else; prints the wheels of WHEELS this interpreter can
                                               install (the rest, 3.12-only builds, stood in)

Run by the project's venv (it reads this interpreter's installed distributions). Exit 1 with one line per problem."""

from __future__ import annotations

import configparser
import importlib.metadata as md
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags, sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
MACHINE = REPO / "scripts" / "gpu_machine_packages.txt"
CARRIED = REPO / "scripts" / "gpu_wheels.txt"
# torch is the GPU machine's own CUDA build (setup.cfg pins the CPU wheel these machines install); bitsandbytes is
# QLoRA's, carried in a second command (.whl-qlora)
NOT_CARRIED = {"torch", "bitsandbytes"}
GPU_ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
           "implementation_name": "cpython", "sys_platform": "linux", "platform_machine": "x86_64",
           "platform_system": "Linux", "os_name": "posix", "extra": ""}
MANYLINUX = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + ["manylinux2014_x86_64", "manylinux2010_x86_64",
                                                                      "manylinux1_x86_64", "linux_x86_64"]
GPU_TAGS = {*cpython_tags((3, 12), platforms=MANYLINUX), *compatible_tags((3, 12), "cp312", MANYLINUX)}


def _names(path: Path) -> dict[str, str | None]:
    """{canonical name: pinned version or None} from a list file (`name` or `name==version` per line)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version or None
    return out


def _hf_zero_requirements() -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = [x.split("#", 1)[0].strip() for x in cfg["options"]["install_requires"].splitlines()]
    return [Requirement(x) for x in lines if x]


def _wheels(folder: Path) -> dict[str, tuple[Version, Path, list[Requirement]]]:
    out, problems = {}, []
    for path in sorted(folder.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(path.name)
        if name in out:
            problems.append(f"{name}: two versions ({out[name][0]} and {version}): the install would stop; keep one")
        if not tags & GPU_TAGS:
            problems.append(f"{path.name}: not installable on the GPU machine (CPython 3.12, manylinux x86_64)")
        with zipfile.ZipFile(path) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            requires = Parser().parsestr(zf.read(meta).decode()).get_all("Requires-Dist") or []
        out[name] = (version, path, [Requirement(r) for r in requires])
    return out, problems


def _unmet(req: Requirement, have: dict[str, Version | None]) -> str | None:
    if req.marker and not req.marker.evaluate(GPU_ENV):
        return None
    name = canonicalize_name(req.name)
    if name not in have:
        return "neither carried nor on the GPU machine"
    version = have[name]
    if version is not None and req.specifier and not req.specifier.contains(version, prereleases=True):
        return f"the GPU machine would have {version}"
    return None


def check(folder: Path, size_limit_mib: float) -> list[str]:
    wheels, problems = _wheels(folder)
    carried = _names(CARRIED)
    problems += [f"{n}: listed in scripts/gpu_wheels.txt but no wheel in {folder}" for n in carried
                 if n not in wheels]
    have = {n: Version(v) if v else None for n, v in _names(MACHINE).items()}
    have.update({n: w[0] for n, w in wheels.items()})  # a carried wheel replaces the machine's copy
    for req in _hf_zero_requirements():
        if canonicalize_name(req.name) not in NOT_CARRIED and (why := _unmet(req, have)):
            problems.append(f"hf_zero needs {req}: {why}")
    for name, (_, path, requires) in wheels.items():
        problems += [f"{path.name} needs {r}: {why}" for r in requires
                     if canonicalize_name(r.name) not in NOT_CARRIED and (why := _unmet(r, have))]
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20
    if size > size_limit_mib:
        problems.append(f"{folder}: {size:.1f} MiB, over the {size_limit_mib:.0f} MiB left beside the working tree")
    print(f"gpu_kit.py: {folder}: {len(wheels)} wheels, {size:.1f} MiB; {len(problems)} problems")
    return problems


def _link_distribution(dist: md.Distribution, site: Path, into: Path) -> None:
    """A distribution's top-level modules and metadata folder, linked (not copied) into `into`."""
    tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    for top in tops:
        src, dst = site / top, into / top
        if src.exists() and not dst.exists() and not top.endswith(".pth") and top != "__pycache__":
            dst.symlink_to(src)


def standins(venv: Path, folder: Path, carried: bool = False) -> list[str]:
    """Link the GPU machine's packages (and with `carried`, scripts/gpu_wheels.txt's where installed here) into the
    venv; return the wheels of `folder` this interpreter installs (the others' distributions are linked instead:
    same name, same version)."""
    names, installable, mine = set(_names(MACHINE)), [], set(sys_tags())
    for path in sorted(folder.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(path.name)
        if tags & mine:
            installable.append(str(path))
        else:
            names.add(name)
    if carried:
        names |= set(_names(CARRIED)) - {parse_wheel_filename(Path(p).name)[0] for p in installable}
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    (venv / "gpu_machine").mkdir(exist_ok=True)
    here = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions(path=[str(site)])}
    # a stand-in brings what it needs here (this machine's huggingface-hub may need more than the GPU's version):
    # its own requirements, never hf_zero's or a carried wheel's, which gpu_kit.py check holds to the GPU machine
    todo, linked = [n for n in names if n in here], set()
    while todo:
        name = todo.pop()
        if name in linked:
            continue
        linked.add(name)
        _link_distribution(here[name], site, venv / "gpu_machine")
        for r in map(Requirement, here[name].requires or []):
            dep = canonicalize_name(r.name)
            if dep in here and (not r.marker or r.marker.evaluate({"extra": ""})):
                todo.append(dep)
    target = next((venv / "lib").glob("python3*/site-packages"))
    # after the venv's own site-packages: what pip installs there replaces the machine's copy, as on the machine
    (target / "gpu_machine.pth").write_text(str(venv / "gpu_machine") + "\n")
    return installable


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "check":
        limit = float(argv[argv.index("--size-limit") + 1]) if "--size-limit" in argv else 56.0
        problems = check(Path(argv[1]), limit)
        for p in problems:
            print(f"gpu_kit.py: {p}", file=sys.stderr)
        return 1 if problems else 0
    if len(argv) in (3, 4) and argv[0] == "standins":
        for path in standins(Path(argv[1]), Path(argv[2]), carried=argv[3:] == ["--carried"]):
            print(path)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
