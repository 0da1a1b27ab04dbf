"""A Hub dataset in a local `datasets` cache, made without the network.

`load_dataset("owner/name", config, split=...)` with the Hub out of reach (HF_HUB_OFFLINE=1)
reads the newest ``<HF_DATASETS_CACHE>/owner___name/<config>/<version>/<commit>/`` folder that
an earlier online load left: ``dataset_info.json`` and ``<name>-<split>.arrow``
(datasets/load.py CachedDatasetModuleFactory, datasets/packaged_modules/cache). An online load
of a Hub repository of parquet files writes that folder with datasets' Parquet builder; this
runs the same builder on local parquet files and moves its output to where the Hub load puts
it (a Hub load names it after the repository; a local builder cannot, it refuses data files
that are not in the repository). Checked against datasets 5.2.0 / huggingface_hub 2.4.0.
"""
from __future__ import annotations

import shutil
from pathlib import Path


def cache_hub_dataset(cache_dir: Path, repo_id: str, config: str, splits: dict[str, dict[str, list]],
                      commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Cache ``splits`` ({split: {column: values}}) as config ``config`` of Hub dataset ``repo_id``
    under ``cache_dir`` (datasets' HF_DATASETS_CACHE); returns the cached folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    owner, name = repo_id.split("/")
    scratch = Path(cache_dir).parent / f"scratch-{owner}-{name}-{config}"
    scratch.mkdir(parents=True)
    files = {}
    for split, columns in splits.items():
        files[split] = str(scratch / f"{split}.parquet")
        pq.write_table(pa.table(columns), files[split])
    builder = Parquet(cache_dir=str(scratch / "cache"), dataset_name=name, config_name=config, data_files=files,
                      hash=commit)
    builder.download_and_prepare()
    dest = Path(cache_dir) / f"{owner}___{name}" / config / str(builder.config.version) / commit
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(builder.cache_dir, dest)
    shutil.rmtree(scratch)
    return dest
