"""The DeepSpeed seam: the only package that imports DeepSpeed (ds_config rules, engine, patches, ingest)."""
