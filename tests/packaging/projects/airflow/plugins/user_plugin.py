"""A user's plugin that imports the user's own ``operators`` package from the plugins folder."""

from airflow.plugins_manager import AirflowPlugin

from operators import SOURCE


def user_marker() -> str:
    return f"user-plugin-{SOURCE}"


class UserPlugin(AirflowPlugin):
    name = "user_plugin"
    macros = [user_marker]
