"""datatrove's ``JsonlReader`` that counts the rows it cannot use, by cause, instead of crashing or dropping files.

datatrove's own reader stops the task on a row whose text is not a string (an int, a list, null), drops the rest of
a file at its first invalid UTF-8 byte (reported as "empty or missing text"), and skips rows without the text key
with a log line only. :class:`CheckedJsonlReader` reads each line as bytes and keeps every good row of a file; each
bad row is skipped and counted under its cause in datatrove's task statistics (``stats/NNNNN.json`` of the logging
folder, key ``"skipped: <cause>"``), and the first few per file are logged with their file and line. Imported only
by ``lit-balance tokenize`` (it needs datatrove).
"""

from __future__ import annotations

import json
from typing import Any

from datatrove.pipeline.readers.base import BaseDiskReader
from datatrove.utils.logging import logger

__all__ = ["CAUSES", "CheckedJsonlReader"]

#: The causes counted, as they appear after ``"skipped: "`` in the task statistics.
CAUSES = ("invalid UTF-8", "invalid JSON", "not a JSON object", "no text key", "text not a string", "empty text")
_LOGGED_PER_FILE = 5


class CheckedJsonlReader(BaseDiskReader):
    """datatrove's ``JsonlReader`` that skips and counts bad rows by cause (see the module docstring); good rows as
    datatrove's (``orjson`` when installed, else the standard library's ``json``).

    Args:
        data_folder: the input folder (any fsspec URL datatrove reads).
        compression: ``"infer"`` (from the file name), ``"gzip"``, ``"zstd"`` or None.
        text_key: the key of the text.
        glob_pattern: which files of the folder to read (None: all, recursively).
        add_file_path: add each document's file path to its metadata (datatrove's option).
    """

    name = "Jsonl (checked rows)"

    def __init__(self, data_folder: Any, compression: str | None = "infer", text_key: str = "text",
                 glob_pattern: str | None = None, add_file_path: bool = False) -> None:
        super().__init__(data_folder, text_key=text_key, glob_pattern=glob_pattern, add_file_path=add_file_path)
        self.compression = compression

    def read_file(self, filepath: str) -> Any:
        try:
            import orjson

            loads, errors = orjson.loads, (orjson.JSONDecodeError, ValueError)
        except ImportError:  # pragma: no cover - orjson comes with the datatrove extra
            loads, errors = json.loads, (ValueError,)
        logged = 0
        with self.data_folder.open(filepath, "rb", compression=self.compression) as handle:
            for number, raw in enumerate(handle, 1):
                if not raw.strip():
                    continue
                with self.track_time():
                    cause, detail, document = None, "", None
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as error:
                        cause, detail = "invalid UTF-8", f"byte {raw[error.start:error.start + 1]!r} at {error.start}"
                    if cause is None:
                        try:
                            row = loads(line)
                        except errors as error:
                            cause, detail = "invalid JSON", str(error)[:80]
                    if cause is None:
                        if not isinstance(row, dict):
                            cause, detail = "not a JSON object", type(row).__name__
                        elif self.text_key not in row:
                            cause, detail = "no text key", f"keys {sorted(row)[:8]}"
                        elif not isinstance(row[self.text_key], str):
                            value = row[self.text_key]
                            cause, detail = "text not a string", f"{type(value).__name__} {str(value)[:40]}"
                        elif not row[self.text_key]:
                            cause = "empty text"
                    if cause is None:
                        document = self.get_document_from_dict(row, filepath, number - 1)
                        if not document:
                            cause = "empty text"
                if cause is not None:
                    self.stat_update(f"skipped: {cause}")
                    if logged < _LOGGED_PER_FILE:
                        logger.warning(f"{filepath}:{number}: skipped, {cause}"
                                       f"{' (' + detail + ')' if detail else ''} (--text-key {self.text_key!r})")
                        logged += 1
                    continue
                yield document
