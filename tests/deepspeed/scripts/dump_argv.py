"""Prints what it was started with: its argv and the PYTHONDTRAIN_PROBE variable, as JSON."""

import json
import os
import sys

print(json.dumps({"argv": sys.argv[1:], "env": os.environ.get("PYTHONDTRAIN_PROBE")}))
