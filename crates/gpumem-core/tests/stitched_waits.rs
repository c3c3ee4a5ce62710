//! When the stitched policy must point a virtual page at another physical page, the host waits
//! only for the work queued before that virtual page went idle, and finds an event recorded
//! after that point: work the device has since finished costs no host wait.
//!
//! Events here complete only when a test says so (as if the device had caught up with the work
//! queued when they were recorded, which a program's own `torch.cuda.synchronize()` does), so
//! each host wait the policy makes is seen in the simulated device's log.

// Only the audited device's setup is used here, not the trace replay beside it.
#[allow(dead_code)]
mod common;

use common::audited_sim;
use gpumem_core::backend::sim::{EventOp, SimControl};
use gpumem_core::backend::DriverCall;
use gpumem_core::{Allocation, Allocator};

const PAGE: u64 = 2 << 20;

fn page_of(a: &Allocation) -> u64 {
    a.ptr / PAGE
}

/// The device catches up with everything queued so far.
fn device_catches_up(ctl: &SimControl) {
    for (e, _) in ctl.take_recorded() {
        ctl.complete(e);
    }
}

fn host_waits(ctl: &SimControl) -> usize {
    ctl.take_ops()
        .iter()
        .filter(|op| matches!(op, EventOp::Synchronize { .. }))
        .count()
}

fn unmaps(alloc: &Allocator) -> u64 {
    alloc.driver_calls().count(DriverCall::MemUnmap)
}

/// One stream at its peak of two pages: a 4 MiB block that does not fit the hole below
/// takes the idle page of that hole as its second page, so that page is mapped at two
/// virtual pages. Returns (the hole's block, the 4 MiB block), both freed again, the device
/// caught up, and the host waits so far forgotten.
fn one_page_at_two_addresses(alloc: &Allocator, ctl: &SimControl) -> (Allocation, Allocation) {
    let p = alloc.allocate(PAGE, 0).unwrap();
    let q = alloc.allocate(PAGE, 0).unwrap();
    alloc.free_allocation(&p).unwrap();
    let s = alloc.allocate(2 * PAGE, 0).unwrap();
    assert_eq!(page_of(&s), page_of(&q) + 1, "placed above q");
    assert_eq!(
        ctl.handle_at(s.ptr + PAGE),
        ctl.handle_at(p.ptr),
        "its second page is p's"
    );
    alloc.free_allocation(&s).unwrap();
    alloc.free_allocation(&q).unwrap();
    device_catches_up(ctl);
    host_waits(ctl);
    (p, s)
}

/// The next step puts a block where q was and one where s was: s's second virtual page needs
/// another physical page (the shared one is in use at p's address), so it is unmapped first.
/// Returns the two blocks.
fn blocks_where_q_and_s_were(alloc: &Allocator, s: &Allocation) -> (Allocation, Allocation) {
    let before = unmaps(alloc);
    let q2 = alloc.allocate(PAGE, 0).unwrap();
    let s2 = alloc.allocate(2 * PAGE, 0).unwrap();
    assert_eq!(s2.ptr, s.ptr);
    assert!(unmaps(alloc) > before, "the test must move a virtual page");
    (q2, s2)
}

/// A page taken back at another virtual page than the one it went idle from leaves that one
/// pointing at a page in use; once the device has passed that point, moving that virtual page
/// to another physical page makes the host wait for nothing.
#[test]
fn a_virtual_page_left_behind_is_moved_without_a_host_wait_once_the_device_has_passed() {
    let (alloc, ctl) = audited_sim("policy:stitched", 64 * PAGE);
    let (p, s) = one_page_at_two_addresses(&alloc, &ctl);
    // p's address takes the shared page back through its first mapping: s's second virtual
    // page is left pointing at it.
    let back = alloc.allocate(PAGE, 0).unwrap();
    assert_eq!(back.ptr, p.ptr);
    assert_eq!(ctl.handle_at(back.ptr), ctl.handle_at(s.ptr + PAGE));
    // The program waits for its work (end of a training step).
    device_catches_up(&ctl);
    let (q2, s2) = blocks_where_q_and_s_were(&alloc, &s);
    assert_ne!(ctl.handle_at(s2.ptr + PAGE), ctl.handle_at(back.ptr));
    assert_eq!(
        host_waits(&ctl),
        0,
        "the device had passed the point where the virtual page went idle"
    );
    for a in [back, q2, s2] {
        alloc.free_allocation(&a).unwrap();
    }
}

/// The wait is for the point where the virtual page itself went idle, not for a later point
/// where its physical page went idle through another virtual page.
#[test]
fn a_virtual_page_waits_for_its_own_idle_point_not_its_physical_pages_later_one() {
    let (alloc, ctl) = audited_sim("policy:stitched", 64 * PAGE);
    let (p, s) = one_page_at_two_addresses(&alloc, &ctl);
    let back = alloc.allocate(PAGE, 0).unwrap();
    assert_eq!(back.ptr, p.ptr);
    device_catches_up(&ctl);
    // The shared page goes idle again through p's address and is taken back there; the work
    // queued since has not run yet.
    alloc.free_allocation(&back).unwrap();
    let again = alloc.allocate(PAGE, 0).unwrap();
    assert_eq!(ctl.handle_at(again.ptr), ctl.handle_at(s.ptr + PAGE));
    let (q2, s2) = blocks_where_q_and_s_were(&alloc, &s);
    assert_eq!(
        host_waits(&ctl),
        0,
        "s's second virtual page went idle before an event the device has passed"
    );
    for a in [again, q2, s2] {
        alloc.free_allocation(&a).unwrap();
    }
}

/// Stream order holds: while the device has not passed the point where the virtual page went
/// idle, it is unmapped only after the host has waited for an event recorded after that point.
#[test]
fn a_virtual_page_left_behind_is_moved_only_after_the_host_waits_while_work_runs() {
    let (alloc, ctl) = audited_sim("policy:stitched", 64 * PAGE);
    let (p, s) = one_page_at_two_addresses(&alloc, &ctl);
    let back = alloc.allocate(PAGE, 0).unwrap();
    assert_eq!(back.ptr, p.ptr);
    // No catching up this time: the work queued before the virtual page went idle may still
    // run when it is needed.
    let (q2, s2) = blocks_where_q_and_s_were(&alloc, &s);
    let ops = ctl.take_ops();
    let waited: Vec<_> = ops
        .iter()
        .filter_map(|op| match op {
            EventOp::Synchronize { event } => Some(*event),
            _ => None,
        })
        .collect();
    assert_eq!(waited.len(), 1, "one host wait before the unmap: {ops:?}");
    assert!(
        ops.iter()
            .any(|op| matches!(op, EventOp::Record { event, .. } if *event == waited[0])),
        "the host waited for an event recorded since the device last caught up: {ops:?}"
    );
    for a in [back, q2, s2] {
        alloc.free_allocation(&a).unwrap();
    }
}
