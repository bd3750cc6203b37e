"""Regenerate hf_kernel_attn/kernels/catalog.json from the live kernel registry.

    python scripts/kernel_catalog.py           # write it
    python scripts/kernel_catalog.py --check   # exit 1 if it is stale

The catalog lets ``hf-kernel-attn list`` describe the built-in kernels without importing torch; run this after
changing a built-in kernel's options, help texts or paper (tests/test_cli.py fails while it is stale).
"""

from __future__ import annotations

import argparse
import sys

from hf_kernel_attn.catalog import CATALOG_PATH, builtin_catalog, live_builtin_catalog, write_catalog


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if catalog.json is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = not CATALOG_PATH.is_file() or builtin_catalog() != live_builtin_catalog()
        print(f"{CATALOG_PATH}: {'stale (run python scripts/kernel_catalog.py)' if stale else 'up to date'}")
        return 1 if stale else 0
    print(f"wrote {write_catalog()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
