#!/usr/bin/env python3
"""Link-time stand-ins for the C library, so that a module linked on a newer
glibc binds only symbol versions an older one has (the wheel's manylinux tag).

    usage: packaging/glibc_stubs.py OUT_DIR [--glibc 2.28] [--cc CC]

For each of the host's libc.so.6, libm.so.6, ld-linux-x86-64.so.2 and the
libraries glibc 2.34 merged into libc (libpthread.so.0, libdl.so.2,
librt.so.1, libutil.so.1, libanl.so.1, libresolv.so.2), OUT_DIR gets a stub
of the same soname whose symbols carry, as their default version, the newest
version no later than --glibc that the host library still exports (newer
glibc keeps every old version as a compatibility symbol), and the link names
(libc.so, libm.so, libpthread.so, ...) the linker takes for -lc, -lm,
-lpthread. Linking with -L OUT_DIR then records, say, pthread_create@GLIBC_2.2.5
where the host's own libc would give pthread_create@GLIBC_2.34. A symbol that
the host glibc 2.34 and later moved into libc (it has a GLIBC_2.34 version
and an older one) goes back to the library that held it before, so that
NEEDED names it and an old glibc finds it there. Symbols no version of which
is that old are left out: a reference to one stays undefined and unversioned,
which packaging/build_wheel.sh refuses.

Needs readelf and, for x86_64, the compiler of the link (--cc; default $CC or
cc). CMake runs it when KVSPLIT_OLDEST_GLIBC is set (packaging/build_wheel.sh).
"""
import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LIBRARIES = ["libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2", "libpthread.so.0", "libdl.so.2",
             "librt.so.1", "libutil.so.1", "libanl.so.1", "libresolv.so.2"]
# Where the symbols that glibc 2.34 moved into libc lived before (glibc 2.34 NEWS).
MOVED = [
    (re.compile(r"dl(addr1?|close|error|info|mopen|open|sym|vsym)$"), "libdl.so.2"),
    (re.compile(r"(aio_|lio_|mq_|__mq_|shm_|timer_)"), "librt.so.1"),
    (re.compile(r"(forkpty|login|login_tty|logout|logwtmp|openpty)$"), "libutil.so.1"),
    (re.compile(r"(gai_|getaddrinfo_a$)"), "libanl.so.1"),
    (re.compile(r"ns_name_"), "libresolv.so.2"),
    (re.compile(r"(_?_?pthread_|sem_|thrd_|mtx_|cnd_|tss_|call_once$)"), "libpthread.so.0"),
]
SYMBOL = re.compile(r"^\s*\d+:\s+[0-9a-f]+\s+(\d+|0x[0-9a-f]+)\s+(FUNC|IFUNC|OBJECT)\s+(GLOBAL|WEAK)\s+"
                    r"DEFAULT\s+\d+\s+([^@\s]+)@@?GLIBC_([0-9.]+)$")


def version(text):
    return tuple(int(part) for part in text.split("."))


def host_library(cc, soname):
    path = subprocess.run([cc, f"-print-file-name={soname}"], capture_output=True, text=True,
                          check=True).stdout.strip()
    return Path(path).resolve() if os.path.isabs(path) else None


def exported(path):
    """{name: (size, type, [versions])} of the library's public GLIBC_* symbols."""
    out = subprocess.run(["readelf", "--dyn-syms", "-W", str(path)], capture_output=True, text=True,
                         check=True).stdout
    symbols = {}
    for line in out.splitlines():
        match = SYMBOL.match(line)
        if match:
            size, kind, _, name, ver = match.groups()
            entry = symbols.setdefault(name, [int(size, 0), kind, []])
            entry[2].append(version(ver))
    return symbols


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--glibc", default="2.28", help="the oldest glibc the module must load on")
    parser.add_argument("--cc", default=os.environ.get("CC", "cc"), help="the link's compiler driver")
    args = parser.parse_args()
    if platform.machine() != "x86_64":
        sys.exit(f"glibc_stubs.py: x86_64 only, not {platform.machine()}")
    cc = args.cc
    limit = version(args.glibc)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    stubs = {soname: {} for soname in LIBRARIES}  # soname -> {name: (size, kind, version)}
    for soname in LIBRARIES:
        path = host_library(cc, soname)
        if path is None:
            if soname in ("libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2"):
                sys.exit(f"glibc_stubs.py: {cc} finds no {soname}")
            continue
        for name, (size, kind, versions) in exported(path).items():
            old = [v for v in versions if v <= limit]
            if not old:
                continue
            target = soname
            if soname == "libc.so.6" and (2, 34) in versions:
                target = next((lib for pattern, lib in MOVED if pattern.match(name)), soname)
            stubs[target].setdefault(name, (size, kind, max(old)))

    counts = []
    with tempfile.TemporaryDirectory() as tmp:
        for soname, symbols in stubs.items():
            by_version, asm = {}, []
            for name, (size, kind, ver) in sorted(symbols.items()):
                by_version.setdefault(ver, []).append(name)
                if kind == "OBJECT":
                    asm += [".data", f".globl {name}", f".type {name},@object", f".size {name},{size}",
                            f"{name}:", f".zero {max(size, 1)}"]
                else:
                    asm += [".text", f".globl {name}", f".type {name},@function", f"{name}:", "ret"]
            script, previous = [], None
            for ver in sorted(by_version):
                node = "GLIBC_" + ".".join(map(str, ver))
                names = "".join(f" {name};" for name in by_version[ver])
                script.append(f"{node} {{ global:{names} }}{' ' + previous if previous else ''};")
                previous = node
            Path(tmp, "stub.s").write_text("\n".join(asm) + "\n")
            Path(tmp, "stub.map").write_text("\n".join(script) + "\n")
            versions = [f"-Wl,--version-script={tmp}/stub.map"] if script else []
            subprocess.run([cc, "-shared", "-nostdlib", f"-Wl,-soname,{soname}", *versions,
                            f"{tmp}/stub.s", "-o", str(out / soname)], check=True)
            counts.append(f"{soname} {len(symbols)}")
            if soname.startswith("lib"):
                link = out / (soname.split(".so")[0] + ".so")
                link.unlink(missing_ok=True)
                if soname == "libc.so.6":
                    # As the host's libc.so: a few functions come from an archive. -lc also
                    # brings what a newer libc holds, so a link that needs no -lpthread there
                    # needs none here.
                    nonshared = host_library(cc, "libc_nonshared.a")
                    also = " ".join(f"{out}/{lib}" for lib in LIBRARIES
                                    if lib not in ("libc.so.6", "libm.so.6"))
                    link.write_text(f"GROUP ( {out}/libc.so.6 {nonshared or ''} "
                                    f"AS_NEEDED ( {also} ) )\n")
                else:
                    link.symlink_to(soname)
    print(f"glibc {args.glibc} stubs in {out}: " + ", ".join(counts))


if __name__ == "__main__":
    main()
