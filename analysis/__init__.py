"""Reports built from run directories: reads files only, never imports torch."""
