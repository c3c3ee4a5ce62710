//! The Prometheus endpoint: the latest sample as gauges, in the OpenMetrics text format that
//! Prometheus scrapes, served over HTTP on a loopback address only (process names and pids
//! are not for the network).

use crate::detect::{Alarm, GrowthDetector};
use crate::source::{GpuSample, MonitorError};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

type Labels = Vec<(String, String)>;
type GaugeF = Gauge<f64, AtomicU64>;

/// The default address of the endpoint.
///
/// Not 9400: that is dcgm-exporter's default, the exporter most GPU machines already run.
/// No port of the Prometheus wiki's exporter range (9100-9999, "Default port allocations")
/// is free of an exporter any more (the range has been fully allocated since 2023, new
/// allocations continue from 10000 up), so the default lies outside it: clear of the
/// exporters found on GPU hosts (node_exporter 9100, dcgm-exporter 9400, nvidia_gpu_exporter
/// 9835), of Prometheus itself (9090-9094) and of Kubernetes' node ports (10248-10260). It is
/// not registered anywhere; `--prometheus ADDR` picks another.
pub const DEFAULT_ADDR: &str = "127.0.0.1:19400";

/// Content type of the OpenMetrics text format.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The metrics and the registry that encodes them.
pub struct Metrics {
    registry: Registry,
    gpu_used: Family<Labels, GaugeF>,
    gpu_total: Family<Labels, GaugeF>,
    gpu_util: Family<Labels, GaugeF>,
    gpu_mem_util: Family<Labels, GaugeF>,
    proc_used: Family<Labels, GaugeF>,
    proc_rate: Family<Labels, GaugeF>,
    proc_baseline: Family<Labels, GaugeF>,
    alarm: Family<Labels, GaugeF>,
    samples: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Empty metrics, registered.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gpumem");
        let mut gauge = |name: &str, help: &str| {
            let family = Family::<Labels, GaugeF>::default();
            registry.register(name, help, family.clone());
            family
        };
        let gpu_used = gauge("gpu_memory_used_bytes", "GPU memory used");
        let gpu_total = gauge("gpu_memory_total_bytes", "GPU memory in total");
        let gpu_util = gauge(
            "gpu_utilization_ratio",
            "Share of the last sample period during which a kernel ran",
        );
        let gpu_mem_util = gauge(
            "gpu_memory_utilization_ratio",
            "Share of the last sample period during which device memory was read or written",
        );
        let proc_used = gauge("process_memory_used_bytes", "GPU memory used by a process");
        let proc_rate = gauge(
            "process_memory_growth_bytes_per_second",
            "Robust slope of a process's GPU memory over the detection window",
        );
        let proc_baseline = gauge(
            "process_memory_baseline_bytes",
            "Learned baseline of a process's GPU memory",
        );
        let alarm = gauge(
            "leak_alarm",
            "1 while a process (pid \"\": a GPU's total) grows steadily",
        );
        let samples = Counter::default();
        registry.register("monitor_samples", "Samples taken", samples.clone());
        Metrics {
            registry,
            gpu_used,
            gpu_total,
            gpu_util,
            gpu_mem_util,
            proc_used,
            proc_rate,
            proc_baseline,
            alarm,
            samples,
        }
    }

    /// Replaces the values with those of the latest sample.
    pub fn update(&mut self, gpus: &[GpuSample], det: &GrowthDetector, alarms: &[Alarm]) {
        for f in [
            &self.gpu_used,
            &self.gpu_total,
            &self.gpu_util,
            &self.gpu_mem_util,
            &self.proc_used,
            &self.proc_rate,
            &self.proc_baseline,
            &self.alarm,
        ] {
            f.clear();
        }
        for g in gpus {
            let gl: Labels = vec![
                ("gpu".into(), g.index.to_string()),
                ("name".into(), g.name.clone()),
                ("uuid".into(), g.uuid.clone()),
            ];
            self.gpu_used.get_or_create(&gl).set(g.used_bytes as f64);
            self.gpu_total.get_or_create(&gl).set(g.total_bytes as f64);
            if let Some(u) = g.util_gpu {
                self.gpu_util.get_or_create(&gl).set(u as f64 / 100.0);
            }
            if let Some(u) = g.util_mem {
                self.gpu_mem_util.get_or_create(&gl).set(u as f64 / 100.0);
            }
            for p in &g.processes {
                let pl: Labels = vec![
                    ("gpu".into(), g.index.to_string()),
                    ("pid".into(), p.pid.to_string()),
                    ("process".into(), p.name.clone()),
                ];
                if let Some(b) = p.used_bytes {
                    self.proc_used.get_or_create(&pl).set(b as f64);
                }
                if let Some(r) = det.rate(g.index, Some(p.pid)) {
                    self.proc_rate.get_or_create(&pl).set(r);
                }
                if let Some(b) = det.baseline(g.index, Some(p.pid)) {
                    self.proc_baseline.get_or_create(&pl).set(b as f64);
                }
                let on = alarms
                    .iter()
                    .any(|a| a.gpu == g.index && a.pid == Some(p.pid));
                self.alarm
                    .get_or_create(&pl)
                    .set(if on { 1.0 } else { 0.0 });
            }
            for a in alarms
                .iter()
                .filter(|a| a.gpu == g.index && a.pid.is_none())
            {
                let pl: Labels = vec![
                    ("gpu".into(), g.index.to_string()),
                    ("pid".into(), String::new()),
                    ("process".into(), a.name.clone()),
                ];
                self.alarm.get_or_create(&pl).set(1.0);
            }
        }
        self.samples.inc();
    }

    /// The OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut s, &self.registry);
        s
    }
}

/// An HTTP server answering `GET /metrics` on a loopback address, in a thread of its own.
pub struct Endpoint {
    metrics: Arc<Mutex<Metrics>>,
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
    addr: SocketAddr,
}

impl Endpoint {
    /// Starts serving on `addr` (a loopback address; port 0 picks a free port).
    pub fn start(addr: &str) -> Result<Self, MonitorError> {
        let sock = addr
            .to_socket_addrs()
            .map_err(|e| MonitorError::Endpoint(format!("'{addr}' is not an address: {e}")))?
            .next()
            .ok_or_else(|| MonitorError::Endpoint(format!("'{addr}' resolves to nothing")))?;
        if !sock.ip().is_loopback() {
            return Err(MonitorError::Endpoint(format!(
                "{sock} is not a loopback address: the endpoint serves this machine only \
                 (use e.g. {DEFAULT_ADDR}, and a reverse proxy to expose it)"
            )));
        }
        let server = tiny_http::Server::http(sock)
            .map_err(|e| MonitorError::Endpoint(format!("cannot listen on {sock}: {e}")))?;
        let addr = server.server_addr().to_ip().unwrap_or(sock);
        let server = Arc::new(server);
        let metrics = Arc::new(Mutex::new(Metrics::new()));
        let (srv, m) = (server.clone(), metrics.clone());
        let thread = std::thread::Builder::new()
            .name("gpumem-metrics".into())
            .spawn(move || serve(&srv, &m))
            .map_err(|e| MonitorError::Endpoint(format!("cannot start its thread: {e}")))?;
        Ok(Self {
            metrics,
            server,
            thread: Some(thread),
            addr,
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Publishes the latest sample.
    pub fn update(&self, gpus: &[GpuSample], det: &GrowthDetector, alarms: &[Alarm]) {
        if let Ok(mut m) = self.metrics.lock() {
            m.update(gpus, det, alarms);
        }
    }
}

fn serve(server: &tiny_http::Server, metrics: &Mutex<Metrics>) {
    use tiny_http::{Header, Method, Response};
    for req in server.incoming_requests() {
        let header = |v: &str| Header::from_bytes("Content-Type", v).ok();
        let resp = match (req.method(), req.url()) {
            (Method::Get, "/metrics") => {
                let body = metrics.lock().map(|m| m.encode()).unwrap_or_default();
                let r = Response::from_string(body);
                match header(CONTENT_TYPE) {
                    Some(h) => r.with_header(h),
                    None => r,
                }
            }
            (Method::Get, "/") => {
                let r = Response::from_string(
                    "<html><body>gpumem monitor: <a href=\"/metrics\">/metrics</a></body></html>",
                );
                match header("text/html; charset=utf-8") {
                    Some(h) => r.with_header(h),
                    None => r,
                }
            }
            (Method::Get, _) => {
                Response::from_string("not found: try /metrics\n").with_status_code(404)
            }
            _ => Response::from_string("only GET\n").with_status_code(405),
        };
        // A client that went away is not our problem.
        let _ = req.respond(resp);
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::DetectorConfig;
    use crate::fake::FakeSource;
    use crate::source::DeviceSource;
    use std::io::{Read, Write};

    fn get(addr: SocketAddr, path: &str) -> (String, String) {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        (head.to_string(), body.to_string())
    }

    #[test]
    fn serves_parseable_metrics_over_tcp() {
        let ep = Endpoint::start("127.0.0.1:0").unwrap();
        let mut src = FakeSource::scenario("leak").unwrap();
        let mut det = GrowthDetector::new(DetectorConfig {
            window_s: 10.0,
            ..Default::default()
        });
        let mut alarms = Vec::new();
        let mut gpus = Vec::new();
        for t in 0..15 {
            gpus = src.sample().unwrap();
            alarms = det.observe(t as f64, &gpus);
            ep.update(&gpus, &det, &alarms);
        }
        assert!(alarms.iter().any(|a| a.pid == Some(4242)), "{alarms:?}");
        let (head, body) = get(ep.addr(), "/metrics");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("application/openmetrics-text"),
            "{head}"
        );
        assert!(body.trim_end().ends_with("# EOF"), "{body}");
        let scrape =
            prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).unwrap();
        let value = |metric: &str, label: &str, v: &str| {
            scrape
                .samples
                .iter()
                .find(|s| s.metric == metric && s.labels.get(label) == Some(v))
                .map(|s| match s.value {
                    prometheus_parse::Value::Gauge(x) | prometheus_parse::Value::Untyped(x) => x,
                    ref other => panic!("{metric}: {other:?}"),
                })
                .unwrap_or_else(|| panic!("no {metric}{{{label}={v}}} in\n{body}"))
        };
        let g = &gpus[0];
        assert_eq!(
            value("gpumem_gpu_memory_used_bytes", "gpu", "0"),
            g.used_bytes as f64
        );
        assert_eq!(
            value("gpumem_gpu_memory_total_bytes", "gpu", "0"),
            g.total_bytes as f64
        );
        let leaky = g.processes.iter().find(|p| p.pid == 4242).unwrap();
        assert_eq!(
            value("gpumem_process_memory_used_bytes", "pid", "4242"),
            leaky.used_bytes.unwrap() as f64
        );
        assert_eq!(value("gpumem_leak_alarm", "pid", "4242"), 1.0);
        assert_eq!(value("gpumem_leak_alarm", "pid", "4141"), 0.0);
        let rate = value(
            "gpumem_process_memory_growth_bytes_per_second",
            "pid",
            "4242",
        );
        assert!((rate - (64u64 << 20) as f64).abs() < 1.0, "{rate}");
        // Every sample line was understood: one per gauge value, plus the counter.
        let lines = body
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .count();
        assert_eq!(scrape.samples.len(), lines);
        assert!(scrape.docs.contains_key("gpumem_leak_alarm"));

        let (head, _) = get(ep.addr(), "/nothing");
        assert!(head.starts_with("HTTP/1.1 404"), "{head}");
        drop(ep); // stops the server thread
    }

    #[test]
    fn the_default_address_is_loopback_and_no_common_exporters_port() {
        let a: SocketAddr = DEFAULT_ADDR.parse().unwrap();
        assert!(a.ip().is_loopback());
        assert_eq!(a.port(), 19400);
        // dcgm-exporter, node_exporter, nvidia_gpu_exporter, Prometheus and its
        // Alertmanager/Pushgateway, and the exporter range of the Prometheus wiki.
        for taken in [9400, 9100, 9835, 9090, 9091, 9093] {
            assert_ne!(a.port(), taken);
        }
        assert!(!(9100..=9999).contains(&a.port()));
    }

    #[test]
    fn refuses_addresses_off_this_machine() {
        let e = Endpoint::start("0.0.0.0:0")
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("loopback"), "{e}");
        let e = Endpoint::start("not an address")
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("not an address"), "{e}");
    }
}
