# Sourced by demo.sh and test.sh: a project-local Airflow home with SQLite, this repo's dags/ and plugins/.
ROOT=${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export PATH="$ROOT/.venv/bin:$PATH"
export AIRFLOW_HOME=${AIRFLOW_HOME:-$ROOT/.airflow}
export AIRFLOW__CORE__DAGS_FOLDER=$ROOT/dags
export AIRFLOW__CORE__PLUGINS_FOLDER=$ROOT/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export DTRAIN_HOME=${DTRAIN_HOME:-$ROOT/.dtrain}
