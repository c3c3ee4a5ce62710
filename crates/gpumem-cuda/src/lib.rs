//! gpumem on a real GPU: the CUDA backend (issue 4). Work in progress.

pub mod replay;
