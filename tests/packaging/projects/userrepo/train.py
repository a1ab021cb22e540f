"""A user's training script: imports its repository's own ``operators`` package, writes a record per rank."""

import operators.helpers

print("wrote", operators.helpers.write_record("script"))
