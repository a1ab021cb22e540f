"""A test stand-in for an auth manager with per-DAG grants (FAB's DAG-level permissions, Keycloak's
resources): Airflow's SimpleAuthManager has roles only, so every viewer may read every DAG there.

Users listed in :data:`GRANTS` may read only the DAGs listed for them; everyone else is decided
by SimpleAuthManager's roles. Everything else (tokens, the API's security dependencies) is
Airflow's own, unchanged.
"""

from __future__ import annotations

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

#: user name -> the DAG ids that user may access (any method)
GRANTS: dict[str, set[str]] = {"outsider": {"some_other_dag"}, "a_only": {"ui_training"}}


class DagScopedAuthManager(SimpleAuthManager):
    def is_authorized_dag(self, *, method, user, access_entity=None, details=None) -> bool:
        grants = GRANTS.get(user.get_name())
        if grants is not None and (details is None or details.id not in grants):
            return False
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)
