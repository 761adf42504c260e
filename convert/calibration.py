"""Calibration text: reading files, the offline default, and cutting token rows.

Files may be plain text, JSONL (one object a line with a "text" field) or parquet (a "text"
column; needs pyarrow). With no --calib, the default is the Brown corpus genres a..j found at
`$QRUN_CALIB_DIR` or `shared/data/text/` beside the repository (`../shared` from its root),
the project's calibration split; brown_k and brown_l are held out for evaluation and are never
used for calibration.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from qrun.errors import QrunError

DEFAULT_GLOB = "brown_[a-j]*.txt"
HELD_OUT = ("brown_k", "brown_l")


class CalibrationError(QrunError):
    """Calibration text is missing, unreadable, empty or too short."""


def default_calibration_files() -> list[Path]:
    roots = []
    if os.environ.get("QRUN_CALIB_DIR"):
        roots.append(Path(os.environ["QRUN_CALIB_DIR"]))
    here = Path(__file__).resolve().parent
    for base in [Path.cwd(), *Path.cwd().parents, here, *here.parents]:
        roots.append(base / "shared" / "data" / "text")
        roots.append(base / ".." / "shared" / "data" / "text")
    for root in roots:
        files = sorted(root.glob(DEFAULT_GLOB)) if root.is_dir() else []
        if files:
            return files
    raise CalibrationError(
        "no --calib file given and the default calibration text (shared/data/text/brown_[a-j]*.txt, "
        "or $QRUN_CALIB_DIR) is not present; pass --calib FILE"
    )


def read_texts(path: Path) -> list[str]:
    """The documents of one calibration file."""
    path = Path(path)
    try:
        if path.suffix.lower() == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise CalibrationError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
            table = pq.read_table(path)
            if "text" not in table.column_names:
                raise CalibrationError(f"{path} has no 'text' column (columns: {', '.join(table.column_names)})")
            return [t for t in table.column("text").to_pylist() if isinstance(t, str)]
        raw = path.read_text(encoding="utf-8")
    except CalibrationError:
        raise
    except UnicodeDecodeError:
        raise CalibrationError(f"calibration file {path} is not UTF-8 text") from None
    except OSError as err:
        raise CalibrationError(f"cannot read calibration file {path}: {err.strerror or err}") from None
    except Exception as err:  # pyarrow errors for corrupt parquet
        raise CalibrationError(f"cannot read calibration file {path}: {err}") from None
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        texts = []
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise CalibrationError(f"{path}:{number} is not valid JSON") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise CalibrationError(f"{path}:{number} has no string 'text' field")
            texts.append(record["text"])
        return texts
    return [raw]


def calibration_rows(files: list[Path], tokenizer, rows: int, row_len: int) -> tuple[torch.Tensor, dict]:
    """[R, L] token ids spread evenly over the text of `files`, and a summary for config.json."""
    for f in files:
        if any(Path(f).name.startswith(h) for h in HELD_OUT):
            raise CalibrationError(f"{f} is held-out evaluation text; calibrate on other text")
    texts = []
    for f in files:
        texts.extend(read_texts(Path(f)))
    text = "\n\n".join(t for t in texts if t.strip())
    if not text.strip():
        raise CalibrationError("the calibration text is empty")
    # Paragraph by paragraph, which the tokenizer runs in parallel; only tokens spanning a
    # paragraph break can differ from encoding the whole text at once.
    paragraphs = [p + "\n\n" for p in text.split("\n\n")]
    ids = [i for piece in tokenizer.encode_many(paragraphs, add_special_tokens=False) for i in piece]
    available = len(ids) // row_len
    if available < 1:
        raise CalibrationError(f"the calibration text has {len(ids)} tokens, fewer than one row of {row_len}; "
                               "give more text or a smaller --calib-len")
    count = min(rows, available)
    stride = available // count
    tensor = torch.tensor(ids[: available * row_len], dtype=torch.long).view(available, row_len)
    picked = tensor[torch.arange(count) * stride]
    summary = {"files": [Path(f).name for f in files], "rows": count, "row_len": row_len,
               "tokens": count * row_len, "text_tokens": len(ids)}
    return picked, summary
