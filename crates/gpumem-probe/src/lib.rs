//! Memory-hierarchy probe and roofline arithmetic (issue 7). Work in progress.
