"""The ``zorro-verl`` command: ``demo`` (the main job), ``bench`` (the benchmark harness), ``doctor`` (checks the
setup of a zorro-enabled verl run) and ``openrlhf`` (installs, removes and checks the OpenRLHF loader: ``zorro-verl
openrlhf {install,uninstall,status [--address ADDR]}``)."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: zorro-verl {demo,bench,doctor,openrlhf} [options]   (zorro-verl demo --help for a command's "
             "options)")
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from zorro_verl.demo import main as demo_main

        return demo_main(rest)
    if cmd == "doctor":
        from zorro_verl.doctor import main as doctor_main

        return doctor_main(rest)
    if cmd == "bench":
        from zorro_verl.bench import main as bench_main

        return bench_main(rest)
    if cmd == "openrlhf":
        from zorro_verl.integrations.openrlhf.boot import main as openrlhf_main

        return openrlhf_main(rest)
    print(f"zorro-verl: unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
