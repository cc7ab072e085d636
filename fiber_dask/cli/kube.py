"""``fiber-dask kubernetes manifest``: the resources a profile creates, as YAML."""

from __future__ import annotations

import click

from ._common import (
    CONTEXT_SETTINGS,
    CLIError,
    apply_config,
    config_option,
    describe_config_error,
)


@click.group("kubernetes", context_settings=CONTEXT_SETTINGS)
def kubernetes() -> None:
    """Kubernetes: what a profile with `backend: kubernetes` creates."""


@kubernetes.command("manifest", context_settings=CONTEXT_SETTINGS)
@config_option
def manifest(config_files: tuple[str, ...]) -> None:
    """Print the YAML documents `kubectl apply -f -` would take for the profile.

    The DaskCluster (scheduler and default worker group, created by the
    dask-kubernetes operator), a DaskWorkerGroup per extra worker group, and a
    DaskAutoscaler when fiber.adaptive is enabled.  The operator must be installed
    in the cluster (see adapters/kubernetes/README.md).

    \b
    Example:
      fiber-dask kubernetes manifest --config adapters/kubernetes.yaml | kubectl apply -f -
    """
    import yaml

    from ..errors import ConfigError

    loaded = apply_config(config_files)
    try:
        from ..backends.kubemanifest import manifests
    except ImportError as e:
        raise CLIError(
            f"the Kubernetes manifest generator is unavailable: {e}"
        ) from None
    try:
        documents = manifests(loaded.fiber)
    except ConfigError as e:
        raise CLIError(describe_config_error(e, loaded.flags)) from None
    except ImportError as e:
        raise CLIError(str(e)) from None
    click.echo(
        yaml.safe_dump_all(documents, sort_keys=False, explicit_start=True), nl=False
    )
