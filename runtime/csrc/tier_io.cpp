// The I/O engine of the NVMe state tier (megacompile/runtime/tier_io.py loads this).
//
// One file per drive; per file, a request queue and `queue_depth` worker threads that run blocking
// pread/pwrite. Why threads and not libaio/io_uring: neither library is installed on the machines we
// build on, and plain threads reach the disk's bandwidth (docs: issue18_design.md, section 1.4), while
// DeepSpeed's libaio op ignores the result of every completion (a full disk "succeeds"). Here every
// result is checked: a short transfer continues for the rest, EINTR is retried, and anything else is
// stored as the request's errno and reported by whoever waits on its ticket.
//
//     Engine e;  e.add_file(path, size, direct, simulate_einval) -> (error, stage, direct in use)
//     t = e.submit(file, is_write, offset, address, nbytes)      queued; returns at once
//     e.wait(t) -> (errno, file, offset, nbytes, is_write)       blocks (no GIL); errno 0: done
//
// Alignment (4 KiB offsets, sizes and addresses) is checked by the Python wrapper before a request is
// submitted, and again here: with O_DIRECT a misaligned request fails with EINVAL at I/O time, which is
// a programming error, never a disk error.
//
// Nothing here is process-wide: every queue, thread, ticket and counter belongs to one Engine.
// pybind11 alone: the engine takes addresses, never tensors, and torch/extension.h (all of ATen)
// would take most of the build
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "check.h"

namespace {

using megatrain::check;

constexpr int64_t kAlign = 4096;
constexpr int kStatusPending = -1;   // a ticket's status: pending, 0 (done) or the errno it failed with

using Clock = std::chrono::steady_clock;

struct Request {
  int64_t ticket;
  bool write;
  int64_t offset;
  int64_t nbytes;
  uint8_t* data;
};

struct Outcome {
  int status = kStatusPending;
  int64_t file = 0, offset = 0, nbytes = 0;
  bool write = false;
};

// Seconds during which at least one request of a kind was in flight: the union of the requests'
// intervals, so that bytes / busy seconds is the bandwidth achieved while the disk was in use.
struct Busy {
  int64_t in_flight = 0;
  Clock::time_point since;
  double seconds = 0.0;

  void start(Clock::time_point now) {
    if (in_flight++ == 0) since = now;
  }
  void stop(Clock::time_point now) {
    if (--in_flight == 0) seconds += std::chrono::duration<double>(now - since).count();
  }
  double total(Clock::time_point now) const {   // including an interval still open
    return seconds + (in_flight > 0 ? std::chrono::duration<double>(now - since).count() : 0.0);
  }
};

struct File {
  std::string path;
  int fd = -1;
  bool direct = false;
  int64_t size = 0;
  std::deque<Request> queue;
  std::condition_variable work;     // a request was queued, or the engine is stopping
  std::vector<std::thread> workers;
  int64_t moved = 0;                // bytes transferred, for the fault injection's threshold
  // test hook (inject): from `inject_at` bytes moved on, every request fails with `inject_error`
  int inject_error = 0;
  int64_t inject_at = 0;
  int64_t delay_us = 0;
};

class Engine {
 public:
  explicit Engine(int64_t queue_depth)
      : queue_depth_(queue_depth < 1 ? 1 : queue_depth), owner_(::getpid()), done_(new std::condition_variable) {}
  ~Engine() {
    close(true);
    if (::getpid() != owner_) (void)done_.release();   // (see close: a forked child must not destroy it)
  }

  // Opens (creating it, mode 0600) and preallocates one file, then starts its workers. Returns
  // (0, "", direct in use) or (errno, "open" | "fallocate", direct): the caller then closes the engine,
  // which removes what was created. With `direct`, EINVAL from open (a file system without O_DIRECT;
  // `simulate_einval` pretends so, for tests) reopens the file buffered.
  std::tuple<int, std::string, bool> add_file(const std::string& path, int64_t size, bool direct,
                                              bool simulate_einval) {
    owned();
    std::lock_guard<std::mutex> lock(mu_);
    check(!closed_, "tier_io: the engine is closed");
    check(size >= 0 && size % kAlign == 0, "tier_io: a file size must be a multiple of 4096");
    auto file = std::make_unique<File>();
    file->path = path;
    file->size = size;
    const int flags = O_RDWR | O_CREAT | O_CLOEXEC;
    int fd = -1;
    if (direct) {
      if (simulate_einval) {
        errno = EINVAL;
      } else {
        fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
      }
      if (fd < 0 && errno != EINVAL) return {errno, "open", true};
      file->direct = fd >= 0;
    }
    if (fd < 0) {
      fd = ::open(path.c_str(), flags, 0600);
      if (fd < 0) return {errno, "open", false};
    }
    file->fd = fd;
    created_.push_back(path);   // (removed by close(remove=true), also after a failed preallocation)
    const bool in_use = file->direct;
    if (size > 0) {
      // Preallocated so that a full disk fails here, before training, and not at some later step. Through
      // a buffered descriptor: where the file system lacks fallocate, glibc emulates it with one-byte
      // writes, which an O_DIRECT descriptor refuses. (posix_fallocate returns the error; errno is unset.)
      const int pfd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
      const int err = pfd < 0 ? errno : ::posix_fallocate(pfd, 0, size);
      if (pfd >= 0) ::close(pfd);
      if (err != 0) {
        ::close(fd);
        file->fd = -1;
        return {err, "fallocate", in_use};
      }
    }
    File* raw = file.get();   // (the workers get the File itself: files_ may grow while they start)
    files_.push_back(std::move(file));
    for (int64_t i = 0; i < queue_depth_; ++i) raw->workers.emplace_back([this, raw] { work(*raw); });
    return {0, "", in_use};
  }

  int64_t submit(int64_t file, bool write, int64_t offset, int64_t address, int64_t nbytes) {
    owned();
    std::lock_guard<std::mutex> lock(mu_);
    check(!closed_, "tier_io: the engine is closed");
    check(file >= 0 && file < static_cast<int64_t>(files_.size()), "tier_io: no file ", file);
    File& f = *files_[file];
    check(offset >= 0 && nbytes >= 0 && offset % kAlign == 0 && nbytes % kAlign == 0 &&
                    address % kAlign == 0 && offset + nbytes <= f.size,
                "tier_io: a request must be 4096-aligned (offset, size, address) and inside its file");
    const int64_t ticket = next_ticket_++;
    Outcome& out = tickets_[ticket];
    out.file = file;
    out.offset = offset;
    out.nbytes = nbytes;
    out.write = write;
    f.queue.push_back(Request{ticket, write, offset, nbytes, reinterpret_cast<uint8_t*>(address)});
    f.work.notify_one();
    return ticket;
  }

  // Blocks until the ticket's request has completed, then forgets the ticket. Returns (errno, file,
  // offset, nbytes, is_write); errno 0: done (also for a ticket already waited, by wait or wait_all).
  std::tuple<int, int64_t, int64_t, int64_t, bool> wait(int64_t ticket) {
    owned();
    std::unique_lock<std::mutex> lock(mu_);
    check(ticket >= 0 && ticket < next_ticket_, "tier_io: no request has ticket ", ticket);
    auto it = tickets_.find(ticket);
    if (it == tickets_.end()) return {0, 0, 0, 0, false};
    done_->wait(lock, [&] {
      auto at = tickets_.find(ticket);
      return at == tickets_.end() || at->second.status != kStatusPending;
    });
    it = tickets_.find(ticket);
    if (it == tickets_.end()) return {0, 0, 0, 0, false};   // (another thread waited it meanwhile)
    const Outcome out = it->second;
    tickets_.erase(it);
    return {out.status, out.file, out.offset, out.nbytes, out.write};
  }

  bool done(int64_t ticket) {
    owned();
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tickets_.find(ticket);
    return it == tickets_.end() || it->second.status != kStatusPending;
  }

  // Waits for every request submitted before the call and forgets their tickets. Returns (mark, errno,
  // file, offset, nbytes, is_write) of the first (lowest ticket) that failed, errno 0 if none did;
  // tickets below `mark` are forgotten.
  std::tuple<int64_t, int, int64_t, int64_t, int64_t, bool> wait_all() {
    owned();
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t mark = next_ticket_;
    done_->wait(lock, [&] {
      for (const auto& [ticket, out] : tickets_) {
        if (ticket >= mark) break;
        if (out.status == kStatusPending) return false;
      }
      return true;
    });
    Outcome first;
    first.status = 0;
    for (auto it = tickets_.begin(); it != tickets_.end() && it->first < mark;) {
      if (it->second.status != 0 && first.status == 0) first = it->second;
      it = tickets_.erase(it);
    }
    return {mark, first.status, first.file, first.offset, first.nbytes, first.write};
  }

  // fdatasync of every file (call after wait_all); then, for a buffered file, drops its now clean pages
  // from the page cache. Returns (errno, file) of the first failure, (0, -1) if none.
  std::tuple<int, int64_t> sync() {
    owned();
    std::vector<std::pair<int, bool>> fds;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& f : files_) fds.emplace_back(f->fd, f->direct);
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].first < 0) continue;
      int rc;
      do {
        rc = ::fdatasync(fds[i].first);
      } while (rc != 0 && errno == EINTR);
      if (rc != 0) return {errno, static_cast<int64_t>(i)};
      if (!fds[i].second) ::posix_fadvise(fds[i].first, 0, 0, POSIX_FADV_DONTNEED);
    }
    return {0, -1};
  }

  // Lets the queued requests finish, joins the workers, closes the files and, with `remove`, unlinks
  // every file this engine created. Idempotent. In a forked child (a DataLoader worker exiting) it only
  // closes its copies of the descriptors: the workers and the files are the parent's.
  void close(bool remove) {
    if (::getpid() != owner_) {
      // A forked child: the parent's workers do not exist here, and the mutex and condition variables
      // are copies that may hold the parent's waiters (a broadcast or a destroy would wait for them
      // forever), so none of them is touched. The child closes its descriptors and leaks the rest.
      if (closed_) return;
      closed_ = true;
      for (auto& f : files_) {
        if (f->fd >= 0) ::close(f->fd);
        (void)f.release();
      }
      files_.clear();
      created_.clear();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      closed_ = true;   // workers drain their queue, then exit
      for (auto& f : files_) f->work.notify_all();
    }
    for (auto& f : files_) {
      for (auto& t : f->workers) t.join();
      f->workers.clear();
      if (f->fd >= 0) ::close(f->fd);
      f->fd = -1;
    }
    if (remove) {
      for (const auto& path : created_) ::unlink(path.c_str());
    }
    created_.clear();
  }

  // (bytes_read, bytes_written, reads, writes, read_busy_s, write_busy_s, busy_s)
  std::tuple<int64_t, int64_t, int64_t, int64_t, double, double, double> counters() {
    owned();
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    return {bytes_read_, bytes_written_, reads_, writes_, read_busy_.total(now), write_busy_.total(now),
            any_busy_.total(now)};
  }

  void reset_counters() {
    owned();
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    bytes_read_ = bytes_written_ = reads_ = writes_ = 0;
    for (Busy* b : {&read_busy_, &write_busy_, &any_busy_}) {
      b->seconds = 0.0;
      b->since = now;   // an interval still open counts from now on
    }
  }

  void inject(int64_t file, int64_t after_bytes, int error, int64_t delay_us) {
    owned();
    std::lock_guard<std::mutex> lock(mu_);
    check(file >= 0 && file < static_cast<int64_t>(files_.size()), "tier_io: no file ", file);
    File& f = *files_[file];
    f.inject_error = error;
    f.inject_at = f.moved + after_bytes;
    f.delay_us = delay_us;
  }

 private:
  // Every method but close() refuses to run in a forked child (its mutex may have been copied locked, and
  // no worker would serve a request).
  void owned() const {
    check(::getpid() == owner_, "tier_io: this engine belongs to process ", owner_,
                "; a forked child cannot use it");
  }

  void work(File& f) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      f.work.wait(lock, [&] { return closed_ || !f.queue.empty(); });
      if (f.queue.empty()) return;   // closed and drained
      const Request req = f.queue.front();
      f.queue.pop_front();
      const int64_t delay_us = f.delay_us;
      auto now = Clock::now();
      Busy& kind = req.write ? write_busy_ : read_busy_;
      kind.start(now);   // (before the injected delay: a slowed drive is busy while it dawdles)
      any_busy_.start(now);
      lock.unlock();
      if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      lock.lock();
      // the injected failure is decided when the request starts, as a syscall's result would be
      const bool injected = f.inject_error != 0 && f.moved >= f.inject_at;
      const int injected_error = f.inject_error;
      lock.unlock();

      int64_t moved = 0;
      const int err = injected ? injected_error : transfer(f, req, &moved);

      lock.lock();
      now = Clock::now();
      kind.stop(now);
      any_busy_.stop(now);
      f.moved += moved;
      if (err == 0) {   // (the counters count whole requests that succeeded, so bytes / busy is the bandwidth)
        (req.write ? bytes_written_ : bytes_read_) += moved;
        ++(req.write ? writes_ : reads_);
      }
      tickets_[req.ticket].status = err;
      done_->notify_all();
    }
  }

  // One request's blocking I/O: short transfers continue for the rest, EINTR is retried. A buffered
  // file's range is written back and dropped from the page cache afterwards, so the cache does not fill
  // with the state the tier keeps out of RAM (and a deferred write-back error is this request's error).
  static int transfer(const File& f, const Request& req, int64_t* moved) {
    while (*moved < req.nbytes) {
      const int64_t left = req.nbytes - *moved;
      const ssize_t r = req.write ? ::pwrite(f.fd, req.data + *moved, left, req.offset + *moved)
                                  : ::pread(f.fd, req.data + *moved, left, req.offset + *moved);
      if (r < 0) {
        if (errno == EINTR) continue;
        return errno;
      }
      if (r == 0) return req.write ? ENOSPC : EIO;   // no progress: a full disk, or a file shorter than planned
      *moved += r;
    }
    if (!f.direct && req.nbytes > 0) {
      if (req.write) {
        int rc = ::sync_file_range(f.fd, req.offset, req.nbytes,
                                   SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
        if (rc != 0 && (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP || errno == ESPIPE)) {
          do {   // a file system without sync_file_range: the whole file, so the range is clean all the same
            rc = ::fdatasync(f.fd);
          } while (rc != 0 && errno == EINTR);
        }
        if (rc != 0) return errno;
      }
      ::posix_fadvise(f.fd, req.offset, req.nbytes, POSIX_FADV_DONTNEED);
    }
    return 0;
  }

  const int64_t queue_depth_;
  const pid_t owner_;                // the process whose threads serve the queues
  std::mutex mu_;                    // guards everything below and every File's queue and counters
  std::unique_ptr<std::condition_variable> done_;   // a request completed
  std::vector<std::unique_ptr<File>> files_;
  std::vector<std::string> created_;
  std::map<int64_t, Outcome> tickets_;
  int64_t next_ticket_ = 0;
  bool closed_ = false;
  int64_t bytes_read_ = 0, bytes_written_ = 0, reads_ = 0, writes_ = 0;
  Busy read_busy_, write_busy_, any_busy_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  // every method runs without the GIL: wait() blocks, and the others take the engine's mutex, which a
  // worker may hold briefly
  py::class_<Engine>(module, "Engine")
      .def(py::init<int64_t>(), py::arg("queue_depth"))
      .def("add_file", &Engine::add_file, release())
      .def("submit", &Engine::submit, release())
      .def("wait", &Engine::wait, release())
      .def("done", &Engine::done, release())
      .def("wait_all", &Engine::wait_all, release())
      .def("sync", &Engine::sync, release())
      .def("close", &Engine::close, release())
      .def("counters", &Engine::counters, release())
      .def("reset_counters", &Engine::reset_counters, release())
      .def("inject", &Engine::inject, release());
}
