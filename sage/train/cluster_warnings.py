"""What breaks on a cluster that the plan (``python -m sage.train.plan``) and the submitit launchers warn
about: the job still runs, but the cluster makes it fail or corrupt records.

- a SQLite MLflow store written from several nodes (a grid of more than one SLURM job, or a job over
  ``hydra.launcher.nodes`` > 1): SQLite's file locks are not reliable on network filesystems; use a server.
- under ``hydra/launcher=slurm``, a folder every job must see (the cache, ``sage.paths.cache_dir()``; the
  SQLite store; the sweep dir) that is not on a network filesystem. The rule is the filesystem type of the
  folder's mount in this machine's ``/proc/mounts`` (nfs, lustre, gpfs, beegfs, ceph, ...: shared; a local
  disk or tmpfs, such as /tmp, or a $HOME on a local disk: not shared), since a path alone cannot say.
"""

from __future__ import annotations

import os
from pathlib import Path

# Filesystem types (/proc/mounts) every node of a cluster sees the same way; anything else is node-local.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "beegfs",
        "fhgfs",
        "ceph",
        "cephfs",
        "fuse.ceph",
        "fuse.cephfs",
        "cifs",
        "smb3",
        "smbfs",
        "glusterfs",
        "fuse.glusterfs",
        "panfs",
        "wekafs",
        "afs",
        "pvfs2",
        "orangefs",
        "fuse.juicefs",
        "fuse.gcsfuse",
        "fuse.s3fs",
    }
)


def mount_of(path: Path, mounts: str) -> tuple[str, str]:
    """(mount point, filesystem type) holding ``path``, from a /proc/mounts text: the longest mount point
    that is a prefix of the path (the last such line: a later mount hides an earlier one, as autofs's)."""
    best = ("/", "unknown")
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == Path(point) or Path(point) in path.parents
        if inside and len(point) >= len(best[0]):
            best = (point, fields[2])
    return best


def shared_folder_warnings(folders: dict[str, Path], mounts: str) -> list[str]:
    """A warning for each folder every SLURM job must see that is on a node-local filesystem."""
    out = []
    for what, folder in folders.items():
        path = Path(os.path.abspath(folder))
        point, fstype = mount_of(path, mounts)
        if fstype not in NETWORK_FILESYSTEMS:
            out.append(
                f"warning: {what} {path} is on {fstype} (mounted at {point}) here, not a network filesystem: "
                "jobs on other nodes will not see it; put it on a shared folder"
            )
    return out


def store_uri(cfg) -> str:
    """The MLflow store sage-train will write (``sage.tracking.resolve_uri``), without creating it."""
    from sage.tracking import default_uri

    configured = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    return configured or default_uri()


def cluster_warnings(cfg, launcher, jobs: int, mounts: str) -> list[str]:
    """What breaks on a cluster: a SQLite store written from several nodes, and, under the SLURM launcher,
    the cache, the SQLite file or the sweep dir on a node-local filesystem."""
    from sage.paths import cache_dir

    slurm = str(launcher._target_).endswith("SlurmLauncher")
    nodes = int(launcher.get("nodes", 1) or 1)
    uri = store_uri(cfg)
    sqlite = uri.startswith("sqlite:///")
    out = []
    if sqlite and slurm and (nodes > 1 or jobs > 1):
        who = f"a job over {nodes} nodes" if nodes > 1 else f"{jobs} SLURM jobs, on any nodes,"
        out.append(
            f"warning: the MLflow store is the SQLite file {uri.removeprefix('sqlite:///')}, and {who} write "
            "it: SQLite's locks are not reliable on a network filesystem; run a tracking server "
            "(scripts/mlflow_server.sh, or PostgreSQL: scripts/postgres.sh) and set tracking.uri "
            "or $MLFLOW_TRACKING_URI"
        )
    if slurm:
        folders = {"the cache (sage.paths.cache_dir(): $SAGE_CACHE_DIR, else ~/.cache/sage)": cache_dir()}
        if sqlite:
            folders["the MLflow SQLite store (tracking.uri / $MLFLOW_TRACKING_URI)"] = Path(
                uri.removeprefix("sqlite:///")
            ).parent
        folders["the sweep dir (hydra.sweep.dir)"] = Path(str(cfg.hydra.sweep.dir))
        out += shared_folder_warnings(folders, mounts)
    return out
