"""``python -m gradtut COMMAND``: the package's command line (so far: ``bench``)."""
import sys

USAGE = "usage: python -m gradtut bench [--quick] [--sections NAME ...] [--out DIR] [--help]"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print("  bench  run the collection's key measurements on this machine "
              "(python -m gradtut bench --help)")
        return 0 if argv else 2
    if argv[0] != "bench":
        sys.stderr.write(f"python -m gradtut: error: unknown command {argv[0]!r}; try 'bench'\n")
        return 2
    from gradtut.bench.command import main as bench

    return bench(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
