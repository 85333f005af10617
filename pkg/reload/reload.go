// Package reload keeps a value read from a file — a mounted Secret such as
// a token file or a keyring — current without a restart: the file is
// re-read when its size or modification time changes, and a version that
// cannot be read, parsed or accepted keeps the last good value, with one
// WARNING until the file is fixed and an INFO line when it is. Messages
// carry the parse error, which must never quote the file's content.
package reload

import (
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// Every is how often Current looks at the file at most.
const Every = time.Second

// File is a value parsed from a file, kept current. Safe for concurrent
// use.
type File[T any] struct {
	path  string
	what  string
	parse func([]byte) (T, error)
	log   *slog.Logger

	// Accept, when set, is a further check of a newly parsed value before
	// it replaces the current one (not of the value Open reads): an error
	// keeps the current value, as a parse error does, but the version is
	// tried again at the next look (what Accept checks may change: a
	// database it asks may come back).
	Accept func(T) error
	// Now is the clock of Current's rate limit (tests move it).
	Now func() time.Time
	// Rejected, when set, is called with the error of every version of
	// the file that is not taken (once per version that fails to read,
	// parse or be accepted; a missing file once per bad spell), to count
	// it. The error never quotes the file's content.
	Rejected func(error)
	// Error logs a rejected version at ERROR instead of WARNING.
	Error bool

	mu       sync.Mutex
	value    T
	checked  time.Time
	modTime  time.Time
	size     int64
	badSince time.Time // the file on disk cannot be used; zero when it can
}

// Open reads and parses the file at path now; what names it in messages
// ("the token file"). An error names the file and what is wrong, as parse
// reports it.
func Open[T any](path, what string, parse func([]byte) (T, error), log *slog.Logger) (*File[T], error) {
	f := &File[T]{path: path, what: what, parse: parse, log: log, Now: time.Now}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	v, err := f.read()
	if err != nil {
		return nil, err
	}
	f.value, f.modTime, f.size, f.checked = v, fi.ModTime(), fi.Size(), f.Now()
	return f, nil
}

// Path is the file's path.
func (f *File[T]) Path() string { return f.path }

// Value is the last good value, without looking at the file.
func (f *File[T]) Value() T {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.value
}

// Current is the last good value after re-reading the file if it changed,
// looking at it at most once per Every.
func (f *File[T]) Current() T {
	f.mu.Lock()
	defer f.mu.Unlock()
	if now := f.Now(); now.Sub(f.checked) >= Every {
		f.checked = now
		f.refresh()
	}
	return f.value
}

// Refresh re-reads the file now if it changed and reports whether a new
// value replaced the current one.
func (f *File[T]) Refresh() (changed bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.checked = f.Now()
	return f.refresh()
}

func (f *File[T]) refresh() bool {
	fi, err := os.Stat(f.path)
	if err != nil {
		err = fmt.Errorf("%s: %w", f.what, err)
		if f.badSince.IsZero() {
			f.rejected(err)
		}
		f.keep(err)
		return false
	}
	if fi.ModTime().Equal(f.modTime) && fi.Size() == f.size {
		return false
	}
	v, err := f.read()
	if err != nil {
		// Not tried again until the file changes again.
		f.modTime, f.size = fi.ModTime(), fi.Size()
		f.rejected(err)
		f.keep(err)
		return false
	}
	if f.Accept != nil {
		if err := f.Accept(v); err != nil {
			err = fmt.Errorf("%s %s: %w", f.what, f.path, err)
			if f.badSince.IsZero() {
				f.rejected(err)
			}
			f.keep(err)
			return false
		}
	}
	f.value, f.modTime, f.size = v, fi.ModTime(), fi.Size()
	if !f.badSince.IsZero() {
		f.log.Info(f.what+" can be used again; its new version is in effect", "path", f.path)
	}
	f.badSince = time.Time{}
	return true
}

func (f *File[T]) read() (T, error) {
	var zero T
	data, err := os.ReadFile(f.path)
	if err != nil {
		return zero, fmt.Errorf("%s: %w", f.what, err)
	}
	v, err := f.parse(data)
	if err != nil {
		return zero, fmt.Errorf("%s %s: %w", f.what, f.path, err)
	}
	return v, nil
}

func (f *File[T]) rejected(err error) {
	if f.Rejected != nil {
		f.Rejected(err)
	}
}

// keep keeps the last good value after err, warning once per bad spell.
func (f *File[T]) keep(err error) {
	if f.badSince.IsZero() {
		f.badSince = f.Now()
		if f.Error {
			f.log.Error("ERROR: "+f.what+" cannot be used; the version read before stays in effect until it is fixed", "error", err)
			return
		}
		f.log.Warn("WARNING: "+f.what+" cannot be used; the version read before stays in effect until it is fixed", "error", err)
	}
}
