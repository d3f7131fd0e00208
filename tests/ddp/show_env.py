"""Print this process's working directory and the environment variables named as arguments (None where unset), as
one JSON object: what a run of ``launch.py`` sees."""

import json
import os
import sys

if __name__ == "__main__":
    print(json.dumps({"cwd": os.getcwd(), **{name: os.environ.get(name) for name in sys.argv[1:]}}))
