"""Raw rows -> the C++ example's input file, through the model's raw-row transformer (the one
``dlrmctl predict`` and ``dlrmctl serve`` apply): a Criteo TSV, or a file in the format of the
schema the model was trained with (multi-valued and weighted columns included)::

    python scripts/cpp_inference/raw_input.py MODEL_DIR RAW_FILE INPUT.bin
    build/dlrm_infer MODEL_DIR INPUT.bin SCORES.bin

Writes ``DLRMIN01`` (``DLRMIN02`` with the per-id weights of a model with weighted features), all
rows as one batch (:func:`dlrmctl.inference.predict.write_cpp_raw_input`); a bad row is one
``error:`` line naming the file, line and column (exit 2).
"""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="an exported model directory (dlrmctl export)")
    ap.add_argument("raw", help="raw rows in the format the model was trained on")
    ap.add_argument("out", help="the C++ input file to write (DLRMIN01 / DLRMIN02)")
    a = ap.parse_args(argv)
    from dlrmctl.errors import UserError
    from dlrmctl.inference.predict import write_cpp_raw_input

    try:
        n = write_cpp_raw_input(a.model_dir, a.raw, a.out)
    except (UserError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} rows to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
