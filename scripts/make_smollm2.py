"""Write SmolLM2-135M-Instruct as a local safetensors checkpoint: python scripts/make_smollm2.py OUT_DIR"""

from __future__ import annotations

import argparse

from tp_runtime.smollm2 import convert_smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", help="directory to write (must be empty unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty directory")
    args = parser.parse_args()
    try:
        print(convert_smollm2(args.out_dir, overwrite=args.overwrite))
    except (FileExistsError, RuntimeError) as e:  # user-fixable: say what to do, no traceback
        parser.exit(1, f"error: {e}\n")


if __name__ == "__main__":
    main()
