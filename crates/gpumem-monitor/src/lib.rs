//! GPU memory monitor (issue 6). Work in progress.
