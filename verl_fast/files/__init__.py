"""Files on disk read and written safely: data-only unpickling (safe_load), writes inside the run
folder that never follow a link (run_files), large files written around the page cache
(direct_write), the folders export and convert write (output_folder)."""
